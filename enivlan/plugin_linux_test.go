package enivlan_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// env is one cloud plus a libcni runtime driving the surrogate eni-vlan.
type env struct {
	cloud *enivlantest.Cloud
	rt    *harness.Runtime
	log   string
	ver   string
}

func newEnv(t testing.TB, ver string, opts enivlantest.CloudOptions, extra map[string]any) *env {
	t.Helper()
	harness.RequireRoot(t)
	bins := []string{enivlantest.BuildSurrogate(t), harness.ReferencePlugins(t)}
	c := enivlantest.NewCloud(t, opts)
	e := &env{cloud: c, ver: ver, log: filepath.Join(t.TempDir(), "eni-vlan.log")}
	if se, ok := t.(interface{ Setenv(k, v string) }); ok {
		se.Setenv(enivlan.LogFileEnv, e.log)
		se.Setenv(enivlan.LogLevelEnv, "info")
	}
	enivlantest.CheckCloserTook(t, e.log)
	e.rt = harness.NewRuntime(t, c.Node, bins, harness.ConfList(t, c.Network, ver, c.PluginConf(extra)))
	return e
}

func randomMAC() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	b[0] = 0x02
	return net.HardwareAddr(b).String()
}

var podSeq int

func (e *env) newPod(t testing.TB) (harness.Pod, *harness.NS) {
	t.Helper()
	n := harness.NewNS(t, "pod")
	podSeq++
	return harness.Pod{ContainerID: harness.ContainerID(), NetNS: n.Path(), Name: fmt.Sprintf("pod-%d", podSeq), Namespace: "default", UID: fmt.Sprintf("uid-%d", podSeq)}, n
}

func (e *env) bound(t testing.TB, vlan int) (harness.Pod, *harness.NS, string) {
	t.Helper()
	p, n := e.newPod(t)
	mac := randomMAC()
	e.cloud.Bind(p, enivlantest.Binding{VLAN: vlan, MAC: mac})
	return p, n, mac
}

func cniCode(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// assertClean checks that nothing of the pod is left: no IPAM allocation,
// no link in the pod or node namespace, no ownership record.
func (e *env) assertClean(t testing.TB, pods ...*harness.NS) {
	t.Helper()
	if a := harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network); len(a) > 0 {
		t.Errorf("host-local still holds %v", a)
	}
	for _, l := range enivlantest.Links(t, e.cloud.Node) {
		if !strings.HasSuffix(l, ":veth") {
			t.Errorf("node netns has link %s, want only the master", l)
		}
	}
	for _, p := range pods {
		if l := enivlantest.Links(t, p); len(l) > 0 {
			t.Errorf("pod %s still has links %v", p.Name, l)
		}
	}
	if r := e.cloud.Records(); len(r) > 0 {
		t.Errorf("ownership records left: %v", r)
	}
}

type linkState struct {
	kind, mac, alias string
	up               bool
	mtu              int
	addrs            []string
	routes           []string
}

func inspect(t testing.TB, n *harness.NS, name string) (linkState, bool) {
	t.Helper()
	var s linkState
	found := false
	n.MustDo(t, func() error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return nil
		}
		found = true
		s.kind, s.mac, s.alias, s.mtu = l.Type(), l.Attrs().HardwareAddr.String(), l.Attrs().Alias, l.Attrs().MTU
		s.up = l.Attrs().Flags&net.FlagUp != 0
		addrs, err := netlinksafe.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if a.IP.IsLinkLocalUnicast() {
				continue
			}
			s.addrs = append(s.addrs, a.IPNet.String())
		}
		routes, err := netlinksafe.RouteList(l, netlink.FAMILY_ALL)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Gw != nil {
				s.routes = append(s.routes, fmt.Sprintf("%v via %s", r.Dst, r.Gw))
			}
		}
		return nil
	})
	return s, found
}

func TestAddCheckDelEveryVersion(t *testing.T) {
	for _, ver := range harness.CNIVersions {
		t.Run(ver, func(t *testing.T) {
			e := newEnv(t, ver, enivlantest.CloudOptions{}, nil)
			ctx := context.Background()
			pod, pns, mac := e.bound(t, 100)
			res, err := e.rt.Add(ctx, pod)
			if err != nil {
				t.Fatalf("ADD: %v", err)
			}
			r, err := current.NewResultFromResult(res)
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Interfaces) != 1 || r.Interfaces[0].Mac != mac || r.Interfaces[0].Sandbox != pod.NetNS || len(r.IPs) != 1 {
				t.Fatalf("result %+v", r)
			}
			st, ok := inspect(t, pns, "eth0")
			if !ok {
				t.Fatal("eth0 missing in pod netns")
			}
			if st.mac != mac || !st.up || st.kind != "macvlan" || st.alias != "eni-vlan-surrogate:vlan=100" {
				t.Errorf("link %+v", st)
			}
			if !slices.Equal(st.addrs, []string{r.IPs[0].Address.String()}) || !slices.Equal(st.routes, []string{"0.0.0.0/0 via 10.77.0.1"}) {
				t.Errorf("addrs %v routes %v", st.addrs, st.routes)
			}
			logs, _ := os.ReadFile(e.log)
			if !strings.Contains(string(logs), "pre-flight ok") || !strings.Contains(string(logs), "TEST BUILD: enivlan_surrogate_link") {
				t.Errorf("log does not show the pre-flight and the surrogate banner:\n%s", logs)
			}
			if err := e.rt.Check(ctx, pod); err != nil {
				t.Errorf("CHECK after ADD: %v", err)
			}
			if ver == "1.1.0" {
				if err := e.rt.Status(ctx); err != nil {
					t.Errorf("STATUS: %v", err)
				}
			}
			if err := e.rt.Del(ctx, pod); err != nil {
				t.Fatalf("DEL: %v", err)
			}
			if err := e.rt.Del(ctx, pod); err != nil {
				t.Fatalf("second DEL: %v", err)
			}
			e.assertClean(t, pns)
		})
	}
}

func TestFailClosedWhenFabricNeverAnswers(t *testing.T) {
	e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{"validationRetries": 2, "validationTimeoutMs": 5})
	pod, pns := e.newPod(t)
	e.cloud.Bind(pod, enivlantest.Binding{VLAN: 100, MAC: randomMAC(), NotEffective: true})
	_, err := e.rt.Add(context.Background(), pod)
	if err == nil {
		t.Fatal("ADD succeeded against a fabric that never answers")
	}
	for _, want := range []string{"no reply from gateway 10.77.0.1", "IP 10.77.0.", "VLAN 100", "with MAC", "after 2 attempt(s)", "IPAM released and link deleted"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	e.assertClean(t, pns)
}
