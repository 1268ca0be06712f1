package e2e

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

var (
	vlanOnce sync.Once
	vlanErr  error
)

// requireVLAN skips unless the kernel can create 802.1Q links.
func requireVLAN(t *testing.T) {
	t.Helper()
	harness.RequireRoot(t)
	vlanOnce.Do(func() {
		n, err := harness.CreateFdNS()
		if err != nil {
			vlanErr = err
			return
		}
		defer n.Close()
		vlanErr = n.Do(func() error {
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vq0"}, PeerName: "vq1"}); err != nil {
				return err
			}
			p, err := netlinksafe.LinkByName("vq0")
			if err != nil {
				return err
			}
			return netlink.LinkAdd(&netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: "vq0.5", ParentIndex: p.Attrs().Index}, VlanId: 5})
		})
	})
	if vlanErr != nil {
		t.Skipf("this kernel cannot create 802.1Q VLAN links (%v): the real-VLAN suite runs in the VM lane (test/vm, make test); the surrogate-link tests in ./enivlan cover the rest here", vlanErr)
	}
}

type env struct {
	cloud *enivlantest.Cloud
	rt    *harness.Runtime
}

var seq int

func newEnv(t *testing.T, ver string, extra map[string]any) *env {
	t.Helper()
	return newEnvOpts(t, ver, enivlantest.CloudOptions{RealVLAN: true}, extra)
}

func newEnvOpts(t *testing.T, ver string, opts enivlantest.CloudOptions, extra map[string]any) *env {
	t.Helper()
	requireVLAN(t)
	bins := []string{harness.BuildOwn(t, "eni-vlan"), harness.ReferencePlugins(t)}
	c := enivlantest.NewCloud(t, opts)
	log := filepath.Join(t.TempDir(), "eni-vlan.log")
	t.Setenv(enivlan.LogFileEnv, log)
	enivlantest.CheckCloserTook(t, log)
	return &env{cloud: c, rt: harness.NewRuntime(t, c.Node, bins, harness.ConfList(t, c.Network, ver, c.PluginConf(extra)))}
}

func randomMAC() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	b[0] = 0x02
	return net.HardwareAddr(b).String()
}

func (e *env) pod(t *testing.T, b enivlantest.Binding) (harness.Pod, *harness.NS) {
	t.Helper()
	n := harness.NewNS(t, "pod")
	seq++
	p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: n.Path(), Name: fmt.Sprintf("pod-%d", seq), Namespace: "default", UID: fmt.Sprintf("uid-%d", seq)}
	if b.MAC == "" {
		b.MAC = randomMAC()
	}
	e.cloud.Bind(p, b)
	return p, n
}

func code(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// vlanOf returns the VLAN ID and MAC of link name in n (0 if it is not a
// VLAN or missing).
func vlanOf(t *testing.T, n *harness.NS, name string) (int, string) {
	t.Helper()
	vid, mac := 0, ""
	n.MustDo(t, func() error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return nil
		}
		if v, ok := l.(*netlink.Vlan); ok {
			vid, mac = v.VlanId, l.Attrs().HardwareAddr.String()
		}
		return nil
	})
	return vid, mac
}

func (e *env) assertClean(t *testing.T, pods ...*harness.NS) {
	t.Helper()
	if a := harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network); len(a) > 0 {
		t.Errorf("host-local still holds %v", a)
	}
	for _, n := range append([]*harness.NS{e.cloud.Node}, pods...) {
		for _, l := range enivlantest.Links(t, n) {
			if strings.HasSuffix(l, ":vlan") {
				t.Errorf("VLAN device %s left in %s", l, n.Name)
			}
		}
	}
	if r := e.cloud.Records(); len(r) > 0 {
		t.Errorf("ownership records left: %v", r)
	}
}

func TestRealVLANAddCheckDel(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			e := newEnv(t, ver, nil)
			ctx := context.Background()
			p, n := e.pod(t, enivlantest.Binding{VLAN: 100})
			if _, err := e.rt.Add(ctx, p); err != nil {
				t.Fatalf("ADD: %v", err)
			}
			vid, _ := vlanOf(t, n, "eth0")
			if vid != 100 {
				t.Fatalf("eth0 VLAN ID %d, want a real 802.1Q link with VLAN 100", vid)
			}
			if err := e.rt.Check(ctx, p); err != nil {
				t.Errorf("CHECK: %v", err)
			}
			for i := range 2 {
				if err := e.rt.Del(ctx, p); err != nil {
					t.Fatalf("DEL %d: %v", i+1, err)
				}
			}
			e.assertClean(t, n)
		})
	}
}

func TestRealVLANFailClosed(t *testing.T) {
	cases := []struct {
		name string
		b    enivlantest.Binding
	}{
		{"binding not pushed", enivlantest.Binding{VLAN: 100, NotEffective: true}},
		{"agent reports the wrong VLAN", enivlantest.Binding{VLAN: 101, FabricVLAN: 102}},
		{"agent reports the wrong MAC", enivlantest.Binding{VLAN: 103, FabricMAC: "02:ee:ee:ee:ee:ee"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, "1.0.0", map[string]any{"validationRetries": 2, "validationTimeoutMs": 50})
			p, n := e.pod(t, tc.b)
			_, err := e.rt.Add(context.Background(), p)
			if code(err) != 11 || !strings.Contains(err.Error(), "cloud binding not effective: no reply from gateway 10.77.0.1") ||
				!strings.Contains(err.Error(), fmt.Sprintf("VLAN %d", tc.b.VLAN)) {
				t.Fatalf("ADD: code %d %v", code(err), err)
			}
			e.assertClean(t, n)
		})
	}
	t.Run("many", func(t *testing.T) {
		e := newEnv(t, "1.0.0", map[string]any{"validationRetries": 1, "validationTimeoutMs": 5})
		n := harness.NewNS(t, "pod")
		for i := range 100 {
			p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: n.Path(), Name: fmt.Sprintf("many-%d", i), Namespace: "default"}
			e.cloud.Bind(p, enivlantest.Binding{VLAN: 200, MAC: randomMAC(), NotEffective: true})
			if _, err := e.rt.Add(context.Background(), p); code(err) != 11 {
				t.Fatalf("ADD %d: code %d %v", i, code(err), err)
			}
		}
		e.assertClean(t, n)
	})
}

func TestRealVLANDelMatrix(t *testing.T) {
	cases := []string{"twice", "without ADD", "empty netns", "deleted netns", "missing link", "gone master"}
	for _, ver := range harness.CNIVersions {
		for _, tc := range cases {
			t.Run(ver+"/"+tc, func(t *testing.T) {
				e := newEnv(t, ver, nil)
				ctx := context.Background()
				p, n := e.pod(t, enivlantest.Binding{VLAN: 300})
				if tc != "without ADD" {
					if _, err := e.rt.Add(ctx, p); err != nil {
						t.Fatalf("ADD: %v", err)
					}
				}
				dp := p
				switch tc {
				case "empty netns":
					dp.NetNS = ""
				case "deleted netns":
					if err := unix.Unmount(p.NetNS, unix.MNT_DETACH); err != nil {
						t.Fatal(err)
					}
					if err := os.Remove(p.NetNS); err != nil {
						t.Fatal(err)
					}
				case "missing link":
					n.MustDo(t, func() error {
						l, err := netlinksafe.LinkByName("eth0")
						if err != nil {
							return err
						}
						return netlink.LinkDel(l)
					})
				case "gone master":
					e.cloud.Node.MustDo(t, func() error {
						l, err := netlinksafe.LinkByName(e.cloud.Master)
						if err != nil {
							return err
						}
						return netlink.LinkDel(l)
					})
				}
				for i := range 2 {
					if err := e.rt.Del(ctx, dp); err != nil {
						t.Fatalf("DEL %d: %v", i+1, err)
					}
				}
				pods := []*harness.NS{n}
				switch tc {
				case "empty netns":
					if err := e.rt.Del(ctx, p); err != nil {
						t.Fatalf("DEL with netns: %v", err)
					}
				case "deleted netns":
					pods = nil
				}
				e.assertClean(t, pods...)
			})
		}
	}
}

func TestRealVLANCheck(t *testing.T) {
	e := newEnv(t, "1.1.0", nil)
	ctx := context.Background()
	p, n := e.pod(t, enivlantest.Binding{VLAN: 400})
	if _, err := e.rt.Add(ctx, p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	with := func(fn func(l netlink.Link) error) {
		n.MustDo(t, func() error {
			l, err := netlinksafe.LinkByName("eth0")
			if err != nil {
				return err
			}
			return fn(l)
		})
	}
	_, mac := vlanOf(t, n, "eth0")
	with(func(l netlink.Link) error {
		return netlink.LinkSetHardwareAddr(l, net.HardwareAddr{0x02, 0xbb, 0, 0, 0, 2})
	})
	if err := e.rt.Check(ctx, p); err == nil || !strings.Contains(err.Error(), "has MAC 02:bb:00:00:00:02") {
		t.Errorf("CHECK with a changed MAC: %v", err)
	}
	hw, _ := net.ParseMAC(mac)
	with(func(l netlink.Link) error { return netlink.LinkSetHardwareAddr(l, hw) })
	with(func(l netlink.Link) error {
		return netlink.RouteDel(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.ParseIP("10.77.0.1")})
	})
	if err := e.rt.Check(ctx, p); err == nil || !strings.Contains(err.Error(), "route 0.0.0.0/0 via 10.77.0.1 is missing") {
		t.Errorf("CHECK with a deleted route: %v", err)
	}
	if err := e.rt.Del(ctx, p); err != nil {
		t.Fatal(err)
	}
	e.assertClean(t, n)
}

// TestRealVLANSameIDTwoPods: Linux allows one VLAN device per master and
// VLAN ID; a live holder is a clear error, a gone one is removed.
func TestRealVLANSameIDTwoPods(t *testing.T) {
	e := newEnv(t, "1.1.0", nil)
	ctx := context.Background()
	a, aNS := e.pod(t, enivlantest.Binding{VLAN: 500})
	if _, err := e.rt.Add(ctx, a); err != nil {
		t.Fatalf("ADD A: %v", err)
	}
	b, bNS := e.pod(t, enivlantest.Binding{VLAN: 500})
	if _, err := e.rt.Add(ctx, b); code(err) != 11 || !strings.Contains(err.Error(), "is in use by pod default/"+a.Name) {
		t.Fatalf("ADD B while A holds VLAN 500: code %d %v", code(err), err)
	}
	e.cloud.Agent.Remove(a.Namespace, a.Name)
	if _, err := e.rt.Add(ctx, b); err != nil {
		t.Fatalf("ADD B after A is gone: %v", err)
	}
	if vid, _ := vlanOf(t, aNS, "eth0"); vid != 0 {
		t.Error("A's stale VLAN device is still there")
	}
	if vid, _ := vlanOf(t, bNS, "eth0"); vid != 500 {
		t.Errorf("B's link VLAN %d, want 500", vid)
	}
	for _, p := range []harness.Pod{a, b} {
		if err := e.rt.Del(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	e.assertClean(t, aNS, bNS)
}

// TestRealVLANDualStack: ARP and NDP pre-flights over a real VLAN; an
// IPv6-only binding that is not pushed fails closed on NDP.
func TestRealVLANDualStack(t *testing.T) {
	t.Run("bound", func(t *testing.T) {
		e := newEnvOpts(t, "1.1.0", enivlantest.CloudOptions{RealVLAN: true, IPv6: true}, nil)
		ctx := context.Background()
		p, n := e.pod(t, enivlantest.Binding{VLAN: 600})
		if _, err := e.rt.Add(ctx, p); err != nil {
			t.Fatalf("ADD: %v", err)
		}
		if vid, _ := vlanOf(t, n, "eth0"); vid != 600 {
			t.Fatalf("VLAN %d, want 600", vid)
		}
		if err := e.rt.Check(ctx, p); err != nil {
			t.Errorf("CHECK: %v", err)
		}
		if err := e.rt.Del(ctx, p); err != nil {
			t.Fatal(err)
		}
		e.assertClean(t, n)
	})
	t.Run("ipv6 only, wrong VLAN", func(t *testing.T) {
		e := newEnvOpts(t, "1.0.0", enivlantest.CloudOptions{RealVLAN: true, IPv6Only: true}, map[string]any{"validationTimeoutMs": 50})
		p, n := e.pod(t, enivlantest.Binding{VLAN: 601, FabricVLAN: 602})
		_, err := e.rt.Add(context.Background(), p)
		if code(err) != 11 || !strings.Contains(err.Error(), "no reply from gateway fd77::1") || !strings.Contains(err.Error(), "VLAN 601") {
			t.Fatalf("ADD: code %d %v", code(err), err)
		}
		e.assertClean(t, n)
	})
}
