package app

import (
	"log/slog"
	"slices"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"

	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/xds/listener"
)

// TestListenerSyncBuildsOnlyOnNewInput: a record stored again with the
// same listener input (a registration or health change) leaves the
// published listeners as they are; a new address republishes them.
func TestListenerSyncBuildsOnlyOnNewInput(t *testing.T) {
	l := newListenerSync(listener.Ports{}, "", slog.New(slog.DiscardHandler))
	rec := func(uid string, ips ...string) *store.Record {
		return &store.Record{Pod: &cniv1.CNIPod{
			ContainerId: "c1", Namespace: "ns", Name: "web", Uid: uid, NetworkNamespace: "/var/run/netns/c1", Ips: ips,
		}}
	}
	name := listener.ListenerName("c1", listener.RoleInbound)
	published := func() *listenerv3.Listener {
		t.Helper()
		r, ok := l.cache.GetResources()[name]
		if !ok {
			t.Fatalf("listener %q not published", name)
		}
		return r.(*listenerv3.Listener)
	}
	tests := []struct {
		name    string
		rec     *store.Record
		rebuilt bool
		addr    string
	}{
		{name: "first store", rec: rec("u1", "10.0.0.2"), rebuilt: true, addr: "0.0.0.0"},
		{name: "same input", rec: rec("u1", "10.0.0.2"), rebuilt: false, addr: "0.0.0.0"},
		{name: "new address family", rec: rec("u1", "fd00::2"), rebuilt: true, addr: "::"},
		{name: "new uid", rec: rec("u2", "fd00::2"), rebuilt: true, addr: "::"},
		{name: "same again", rec: rec("u2", "fd00::2"), rebuilt: false, addr: "::"},
	}
	var prev *listenerv3.Listener
	for _, tt := range tests {
		l.RecordStored(tt.rec)
		got := published()
		if rebuilt := got != prev; rebuilt != tt.rebuilt {
			t.Errorf("%s: rebuilt = %v, want %v", tt.name, rebuilt, tt.rebuilt)
		}
		if a := got.GetAddress().GetSocketAddress().GetAddress(); a != tt.addr {
			t.Errorf("%s: address %q, want %q", tt.name, a, tt.addr)
		}
		prev = got
	}
	if n := l.cache.NumResources(); n != len(listener.Roles) {
		t.Fatalf("%d listeners published, want %d", n, len(listener.Roles))
	}
}

// TestListenerSyncPrepare: Prepare builds without publishing; RecordStored
// publishes that build when the input is the one prepared, and builds
// again when the record changed in between; RecordRemoved drops a
// prepared build.
func TestListenerSyncPrepare(t *testing.T) {
	rec := func(cid string, ips ...string) *store.Record {
		return &store.Record{Pod: &cniv1.CNIPod{
			ContainerId: cid, Namespace: "ns", Name: "web", Uid: "u1", NetworkNamespace: "/var/run/netns/" + cid, Ips: ips,
		}}
	}
	tests := []struct {
		name         string
		prepared     *store.Record
		stored       *store.Record
		wantPrepared bool // the published listener is the prepared one
		wantAddr     string
	}{
		{name: "same input", prepared: rec("c1", "10.0.0.2"), stored: rec("c1", "10.0.0.2"), wantPrepared: true, wantAddr: "0.0.0.0"},
		{name: "changed in between", prepared: rec("c1", "10.0.0.2"), stored: rec("c1", "fd00::2"), wantPrepared: false, wantAddr: "::"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newListenerSync(listener.Ports{}, "", slog.New(slog.DiscardHandler))
			l.Prepare(tt.prepared)
			if n := l.cache.NumResources(); n != 0 {
				t.Fatalf("Prepare published %d listeners", n)
			}
			name := listener.ListenerName("c1", listener.RoleInbound)
			var pre *listenerv3.Listener
			for _, x := range l.prepared["c1"].ls {
				if x.GetName() == name {
					pre = x
				}
			}
			if pre == nil {
				t.Fatalf("Prepare built no %q", name)
			}
			l.RecordStored(tt.stored)
			got := l.cache.GetResources()[name].(*listenerv3.Listener)
			if (got == pre) != tt.wantPrepared {
				t.Errorf("published the prepared build: %v, want %v", got == pre, tt.wantPrepared)
			}
			if a := got.GetAddress().GetSocketAddress().GetAddress(); a != tt.wantAddr {
				t.Errorf("address %q, want %q", a, tt.wantAddr)
			}
			if len(l.prepared) != 0 {
				t.Errorf("%d prepared builds left after RecordStored", len(l.prepared))
			}
		})
	}
	l := newListenerSync(listener.Ports{}, "", slog.New(slog.DiscardHandler))
	l.Prepare(rec("c2", "10.0.0.3"))
	l.RecordRemoved("c2")
	if len(l.prepared) != 0 {
		t.Fatalf("%d prepared builds left after RecordRemoved", len(l.prepared))
	}
}

// TestListenerSyncDeclaredPorts: a record's declared ports reach the
// published listeners (unknown for a record without them, known and empty
// for a pod declaring none), and a change of them republishes.
func TestListenerSyncDeclaredPorts(t *testing.T) {
	l := newListenerSync(listener.Ports{}, "", slog.New(slog.DiscardHandler))
	name := listener.ListenerName("c1", listener.RoleInbound)
	for _, tc := range []struct {
		name  string
		dp    *cniv1.DeclaredPorts
		known bool
		want  []uint16
	}{
		{name: "old record: unknown"},
		{name: "declares none", dp: &cniv1.DeclaredPorts{}, known: true},
		{name: "declares two", dp: &cniv1.DeclaredPorts{Tcp: []uint32{80, 8080}}, known: true, want: []uint16{80, 8080}},
	} {
		l.RecordStored(&store.Record{Pod: &cniv1.CNIPod{
			ContainerId: "c1", Namespace: "ns", Name: "web", NetworkNamespace: "/var/run/netns/c1", Ips: []string{"10.0.0.2"},
			DeclaredPorts: tc.dp,
		}})
		r, ok := l.cache.GetResources()[name]
		if !ok {
			t.Fatalf("%s: listener %q not published", tc.name, name)
		}
		s, err := listener.Parse(r.(*listenerv3.Listener))
		if err != nil {
			t.Fatal(err)
		}
		if s.DeclaredPortsKnown != tc.known || !slices.Equal(s.DeclaredTCPPorts, tc.want) {
			t.Errorf("%s: published declared ports known=%v %v, want known=%v %v", tc.name, s.DeclaredPortsKnown, s.DeclaredTCPPorts, tc.known, tc.want)
		}
	}
}
