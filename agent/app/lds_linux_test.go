package app

import (
	"log/slog"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"

	"aether.io/node/agent/store"
	"aether.io/node/agent/uds"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/xds/listener"
)

// TestListenersCarryTheUDSSocket: the listeners of a pod whose record
// resolves a UDS socket name it (the proxy delivers inbound there); a
// refused one (an emptyDir) and none leave it empty (TCP).
func TestListenersCarryTheUDSSocket(t *testing.T) {
	for _, tc := range []struct {
		name, annotation, want string
	}{
		{"csi volume", "mesh/app.sock", "/run/aether/uds/uid-1/app.sock"},
		{"emptyDir refused", "data/app.sock", ""},
		{"not asked", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newListenerSync(listener.Ports{}, "/run/aether/uds", slog.New(slog.DiscardHandler))
			p := &cniv1.CNIPod{
				Namespace: "ns", Name: "web", Uid: "uid-1", ContainerId: "c1", NetworkNamespace: "/run/netns/p",
				Ips: []string{"10.0.0.2"}, UdsCsiVolume: "mesh", UdsCsiVolumes: 1, Volumes: []string{"mesh", "data"},
			}
			if tc.annotation != "" {
				p.Annotations = map[string]string{uds.Annotation: tc.annotation}
			}
			l.RecordStored(&store.Record{Pod: p})
			res := l.cache.GetResources()
			if len(res) != len(listener.Roles) {
				t.Fatalf("published %d listeners, want %d", len(res), len(listener.Roles))
			}
			for name, r := range res {
				s, err := listener.Parse(r.(*listenerv3.Listener))
				if err != nil {
					t.Fatal(err)
				}
				if s.UDSSocket != tc.want {
					t.Errorf("listener %s UDS socket %q, want %q", name, s.UDSSocket, tc.want)
				}
			}
		})
	}
}

// TestListenersFollowTheUDSSocket: a record stored again with a UDS socket
// it did not resolve before (the same container, ips and netns) publishes
// listeners naming it: the socket is part of what the listeners are built
// from.
func TestListenersFollowTheUDSSocket(t *testing.T) {
	l := newListenerSync(listener.Ports{}, "/run/aether/uds", slog.New(slog.DiscardHandler))
	p := &cniv1.CNIPod{
		Namespace: "ns", Name: "web", Uid: "uid-1", ContainerId: "c1", NetworkNamespace: "/run/netns/p",
		Ips: []string{"10.0.0.2"}, UdsCsiVolume: "mesh", UdsCsiVolumes: 1, Volumes: []string{"mesh"},
	}
	sockets := func() map[string]bool {
		out := map[string]bool{}
		for _, r := range l.cache.GetResources() {
			s, err := listener.Parse(r.(*listenerv3.Listener))
			if err != nil {
				t.Fatal(err)
			}
			out[s.UDSSocket] = true
		}
		return out
	}
	l.RecordStored(&store.Record{Pod: p})
	if got := sockets(); len(got) != 1 || !got[""] {
		t.Fatalf("before the annotation: UDS sockets %v, want none", got)
	}
	p.Annotations = map[string]string{uds.Annotation: "mesh/app.sock"}
	l.RecordStored(&store.Record{Pod: p})
	if got := sockets(); len(got) != 1 || !got["/run/aether/uds/uid-1/app.sock"] {
		t.Fatalf("after the annotation: UDS sockets %v, want the resolved one", got)
	}
}
