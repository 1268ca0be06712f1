package proxy

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/types/known/anypb"

	"aether.io/node/proxy/identity/spire"
	"aether.io/node/xds/listener"
	"aether.io/node/xds/resource"
)

// TestListenersDriveWantedIdentities: the identities the SPIRE provider
// subscribes to follow the SPIFFE IDs of the pods' listeners (distinct,
// invalid ones left out), so a pod's SVID is fetched while it is served
// and released when its listeners go.
func TestListenersDriveWantedIdentities(t *testing.T) {
	dir := t.TempDir()
	p, err := New(Config{XDSTarget: "unix://" + filepath.Join(dir, "xds.sock"), NodeID: "n1", SPIREAdminSocket: filepath.Join(dir, "admin.sock")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Manager.Close() })
	sp := p.Identity.(*spire.Provider)
	res := func(i int, sa string) []*discovery.Resource {
		ls, err := listener.Build(listener.Pod{
			ContainerID: fmt.Sprintf("c%d", i), Namespace: "shop", Name: fmt.Sprintf("p%d", i), UID: fmt.Sprintf("u%d", i),
			NetNSPath: filepath.Join(dir, "netns", fmt.Sprint(i)), IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})},
			SPIFFEID: "spiffe://cluster.local/ns/shop/sa/" + sa,
		})
		if err != nil {
			t.Fatal(err)
		}
		var out []*discovery.Resource
		for _, l := range ls {
			a, err := anypb.New(l)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, &discovery.Resource{Name: l.GetName(), Resource: a})
		}
		return out
	}
	web1, web2, db := res(1, "web"), res(2, "web"), res(3, "db")
	all := append(append(append([]*discovery.Resource{}, web1...), web2...), db...)
	if err := p.apply(resource.ListenerType, all, nil); err != nil {
		t.Fatal(err)
	}
	if w := sp.Stats().Wanted; w != 2 {
		t.Fatalf("wanted %d identities for pods of web, web and db; want 2", w)
	}
	var gone []string
	for _, r := range db {
		gone = append(gone, r.GetName())
	}
	if err := p.apply(resource.ListenerType, nil, gone); err != nil {
		t.Fatal(err)
	}
	if w := sp.Stats().Wanted; w != 1 {
		t.Fatalf("wanted %d identities after db's listeners went; want 1", w)
	}
}
