package enivlan_test

import (
	"context"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/test/harness"
)

// TestDelMatrix: DEL succeeds and releases everything twice, without ADD,
// with an empty netns, a deleted netns, a missing link and a gone master, at
// every CNI version.
func TestDelMatrix(t *testing.T) {
	cases := []struct {
		name string
		// before runs after ADD (when add) and returns the pod to DEL.
		add    bool
		before func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod
	}{
		{name: "twice", add: true},
		{name: "without ADD"},
		{name: "empty netns", add: true, before: func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod {
			p.NetNS = ""
			return p
		}},
		{name: "deleted netns", add: true, before: func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod {
			// Unmount and remove the path as the runtime does; the harness
			// still holds the namespace's fd and releases it in cleanup.
			if err := unix.Unmount(p.NetNS, unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(p.NetNS); err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{name: "netns unmounted, file left", add: true, before: func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod {
			if err := unix.Unmount(p.NetNS, unix.MNT_DETACH); err != nil {
				t.Fatal(err)
			}
			return p
		}},
		{name: "missing link", add: true, before: func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod {
			n.MustDo(t, func() error {
				l, err := netlinksafe.LinkByName("eth0")
				if err != nil {
					return err
				}
				return netlink.LinkDel(l)
			})
			return p
		}},
		{name: "gone master", add: true, before: func(t *testing.T, e *env, p harness.Pod, n *harness.NS) harness.Pod {
			e.cloud.Node.MustDo(t, func() error {
				l, err := netlinksafe.LinkByName(e.cloud.Master)
				if err != nil {
					return err
				}
				return netlink.LinkDel(l)
			})
			return p
		}},
	}
	for _, ver := range harness.CNIVersions {
		for _, tc := range cases {
			t.Run(ver+"/"+tc.name, func(t *testing.T) {
				e := newEnv(t, ver, enivlantest.CloudOptions{}, nil)
				ctx := context.Background()
				p, n, _ := e.bound(t, 200)
				if tc.add {
					if _, err := e.rt.Add(ctx, p); err != nil {
						t.Fatalf("ADD: %v", err)
					}
					if len(harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network)) != 1 {
						t.Fatal("ADD left no allocation")
					}
				}
				dp := p
				if tc.before != nil {
					dp = tc.before(t, e, p, n)
				}
				for i := range 2 {
					if err := e.rt.Del(ctx, dp); err != nil {
						t.Fatalf("DEL %d: %v", i+1, err)
					}
				}
				if tc.name == "empty netns" {
					// The runtime's second DEL carries the netns again.
					if err := e.rt.Del(ctx, p); err != nil {
						t.Fatalf("DEL with netns: %v", err)
					}
				}
				pods := []*harness.NS{n}
				if tc.name == "deleted netns" || tc.name == "netns unmounted, file left" {
					pods = nil
				}
				e.assertClean(t, pods...)
			})
		}
	}
}

// TestCheck: CHECK passes after ADD and catches a changed MAC, a deleted
// route, a changed MTU and an agent that now binds another VLAN.
func TestCheck(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			e := newEnv(t, ver, enivlantest.CloudOptions{}, nil)
			ctx := context.Background()
			p, n, mac := e.bound(t, 300)
			if _, err := e.rt.Add(ctx, p); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after ADD: %v", err)
			}
			withLink := func(fn func(l netlink.Link) error) {
				n.MustDo(t, func() error {
					l, err := netlinksafe.LinkByName("eth0")
					if err != nil {
						return err
					}
					return fn(l)
				})
			}
			expectFail := func(what, want string) {
				t.Helper()
				err := e.rt.Check(ctx, p)
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("CHECK with %s: got %v, want an error containing %q", what, err, want)
				}
			}
			// Changed MAC.
			withLink(func(l netlink.Link) error {
				return netlink.LinkSetHardwareAddr(l, net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 1})
			})
			expectFail("a changed MAC", "has MAC 02:bb:00:00:00:01, prevResult says "+mac)
			hw, _ := net.ParseMAC(mac)
			withLink(func(l netlink.Link) error { return netlink.LinkSetHardwareAddr(l, hw) })
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after restoring the MAC: %v", err)
			}
			// Deleted route.
			withLink(func(l netlink.Link) error {
				return netlink.RouteDel(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: nil, Gw: net.ParseIP("10.77.0.1")})
			})
			expectFail("a deleted route", "route 0.0.0.0/0 via 10.77.0.1 is missing")
			withLink(func(l netlink.Link) error {
				return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP("10.77.0.1")})
			})
			if err := e.rt.Check(ctx, p); err != nil {
				t.Fatalf("CHECK after restoring the route: %v", err)
			}
			// Changed MTU.
			withLink(func(l netlink.Link) error { return netlink.LinkSetMTU(l, 1400) })
			expectFail("a changed MTU", "has MTU 1400")
			withLink(func(l netlink.Link) error { return netlink.LinkSetMTU(l, 1500) })
			// Removed address.
			withLink(func(l netlink.Link) error {
				addrs, err := netlinksafe.AddrList(l, netlink.FAMILY_V4)
				if err != nil || len(addrs) == 0 {
					t.Fatalf("addresses: %v %v", addrs, err)
				}
				return netlink.AddrDel(l, &addrs[0])
			})
			expectFail("a removed address", "failed to check addresses")
			if err := e.rt.Del(ctx, p); err != nil {
				t.Fatal(err)
			}
			// The agent now binds another VLAN: CHECK of a fresh pod fails.
			p2, _, mac2 := e.bound(t, 301)
			if _, err := e.rt.Add(ctx, p2); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			e.cloud.Bind(p2, enivlantest.Binding{VLAN: 302, MAC: mac2})
			if err := e.rt.Check(ctx, p2); err == nil || !strings.Contains(err.Error(), "VLAN ID 301, want 302") {
				t.Errorf("CHECK with a re-bound VLAN: %v", err)
			}
			if err := e.rt.Del(ctx, p2); err != nil {
				t.Fatal(err)
			}
		})
	}
}
