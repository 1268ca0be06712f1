package peers_test

import (
	"net/netip"
	"reflect"
	"testing"

	"aether.io/node/api/istio/workload"
	"aether.io/node/proxy/peers"
)

func raw(s string) []byte { return netip.MustParseAddr(s).AsSlice() }

func TestIndex(t *testing.T) {
	x := peers.NewIndex()
	x.Upsert(&workload.Workload{
		Uid: "k//Pod/a/web-1", Name: "web-1", Namespace: "a", WorkloadName: "web",
		CanonicalName: "web-svc", Addresses: [][]byte{raw("10.0.0.5"), raw("fd00::5"), []byte("bad")},
	})
	x.Upsert(&workload.Workload{Uid: "k//Pod/b/db-0", Name: "db-0", Namespace: "b", Addresses: [][]byte{raw("10.0.0.6")}})

	tests := []struct {
		addr string
		want peers.Peer
		ok   bool
	}{
		{"10.0.0.5", peers.Peer{UID: "k//Pod/a/web-1", Workload: "web", Name: "web-1", Namespace: "a", CanonicalName: "web-svc"}, true},
		{"::ffff:10.0.0.5", peers.Peer{UID: "k//Pod/a/web-1", Workload: "web", Name: "web-1", Namespace: "a", CanonicalName: "web-svc"}, true},
		{"fd00::5", peers.Peer{UID: "k//Pod/a/web-1", Workload: "web", Name: "web-1", Namespace: "a", CanonicalName: "web-svc"}, true},
		{"10.0.0.6", peers.Peer{UID: "k//Pod/b/db-0", Workload: "db-0", Name: "db-0", Namespace: "b"}, true},
		{"10.0.0.7", peers.Peer{}, false},
	}
	for _, tc := range tests {
		got, ok := x.Lookup(netip.MustParseAddr(tc.addr))
		if ok != tc.ok || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Lookup(%s) = %+v, %v; want %+v, %v", tc.addr, got, ok, tc.want, tc.ok)
		}
	}
	// An update moves the workload to a new address; the old one is gone.
	x.Upsert(&workload.Workload{Uid: "k//Pod/b/db-0", Name: "db-0", Namespace: "b", Addresses: [][]byte{raw("10.0.0.9")}})
	if _, ok := x.Lookup(netip.MustParseAddr("10.0.0.6")); ok {
		t.Error("old address still indexed after update")
	}
	if p, ok := x.Lookup(netip.MustParseAddr("10.0.0.9")); !ok || p.Workload != "db-0" {
		t.Errorf("new address: %+v %v", p, ok)
	}
	// An address taken over by another workload is not dropped by the
	// first one's removal.
	x.Upsert(&workload.Workload{Uid: "k//Pod/a/web-2", Name: "web-2", Namespace: "a", Addresses: [][]byte{raw("10.0.0.5")}})
	x.Remove("k//Pod/a/web-1")
	if p, ok := x.Lookup(netip.MustParseAddr("10.0.0.5")); !ok || p.UID != "k//Pod/a/web-2" {
		t.Errorf("reused address after removal of the old owner: %+v %v", p, ok)
	}
	if _, ok := x.Lookup(netip.MustParseAddr("fd00::5")); ok {
		t.Error("removed workload's address still indexed")
	}
	if x.Len() != 2 {
		t.Errorf("Len = %d, want 2", x.Len())
	}
}
