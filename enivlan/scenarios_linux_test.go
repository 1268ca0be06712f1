package enivlan_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/test/harness"
)

// TestAgentAnswers drives ADD through each answer the agent can give.
func TestAgentAnswers(t *testing.T) {
	cases := []struct {
		name     string
		b        enivlantest.Binding
		ok       bool
		code     uint
		contains string
	}{
		{name: "404 while the cache lags, then the binding", b: enivlantest.Binding{NotFoundFirst: 3}, ok: true},
		{name: "vlan and mac arrive late", b: enivlantest.Binding{IncompleteFirst: 2}, ok: true},
		{name: "vlan missing", b: enivlantest.Binding{Answer: enivlantest.MissingVLAN}, code: 11, contains: `has no "vlan"`},
		{name: "mac missing", b: enivlantest.Binding{Answer: enivlantest.MissingMAC}, code: 11, contains: `has no "mac"`},
		{name: "500", b: enivlantest.Binding{Answer: enivlantest.ServerError}, code: 11, contains: "HTTP 500"},
		{name: "422 is not retried", b: enivlantest.Binding{Answer: enivlantest.Unprocessable}, code: 999, contains: "HTTP 422"},
		{name: "required field missing", b: enivlantest.Binding{Answer: enivlantest.MissingRequired}, code: 11, contains: "required fields missing: node"},
		{name: "vlan out of range", b: enivlantest.Binding{VLAN: 4095}, code: 999, contains: `"vlan" 4095: want 1..4094`},
		{name: "multicast mac", b: enivlantest.Binding{MAC: "01:00:5e:00:00:01"}, code: 999, contains: "want a unicast"},
		{name: "stale uid", b: enivlantest.Binding{ReportUID: "uid-old"}, code: 11, contains: "stale record"},
		{name: "ip of another pod", b: enivlantest.Binding{IPv4: "10.77.0.200/24"}, code: 11, contains: "but IPAM allocated"},
		{name: "slow agent", b: enivlantest.Binding{Delay: time.Hour}, code: 11, contains: "context deadline exceeded"},
		{name: "wrong MAC fails closed", b: enivlantest.Binding{FabricMAC: "02:ee:ee:ee:ee:ee"}, code: 11, contains: "cloud binding not effective"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			budget := 300
			if tc.ok {
				budget = 10000
			}
			e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{"endpointTimeoutMs": budget, "validationTimeoutMs": 50})
			p, n := e.newPod(t)
			b := tc.b
			if b.VLAN == 0 {
				b.VLAN = 500
			}
			if b.MAC == "" {
				b.MAC = randomMAC()
			}
			e.cloud.Bind(p, b)
			_, err := e.rt.Add(context.Background(), p)
			if tc.ok {
				if err != nil {
					t.Fatalf("ADD: %v", err)
				}
				if err := e.rt.Del(context.Background(), p); err != nil {
					t.Fatal(err)
				}
			} else {
				if err == nil {
					t.Fatal("ADD succeeded")
				}
				if cniCode(err) != tc.code || !strings.Contains(err.Error(), tc.contains) {
					t.Errorf("got code %d %v; want code %d containing %q", cniCode(err), err, tc.code, tc.contains)
				}
			}
			e.assertClean(t, n)
		})
	}
}

func TestConfigErrorsAreCode7(t *testing.T) {
	cases := []struct {
		name     string
		extra    map[string]any
		contains string
	}{
		{"vlanId", map[string]any{"vlanId": 100}, "community vlan CNI plugin"},
		{"vlanMode", map[string]any{"vlanMode": "auto"}, "community vlan CNI plugin"},
		{"mtu above master", map[string]any{"mtu": 9000}, `"mtu" 9000: want at most the MTU of master "ens5" (1500)`},
		{"master missing", map[string]any{"master": "nope0"}, `"master" "nope0": no such interface`},
		{"retries", map[string]any{"validationRetries": 0}, `"validationRetries" 0: want 1..20`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, "1.1.0", enivlantest.CloudOptions{}, tc.extra)
			p, n, _ := e.bound(t, 600)
			_, err := e.rt.Add(context.Background(), p)
			if cniCode(err) != 7 || !strings.Contains(err.Error(), tc.contains) {
				t.Errorf("got code %d %v; want code 7 containing %q", cniCode(err), err, tc.contains)
			}
			// DEL with the same config still releases and succeeds.
			if err := e.rt.Del(context.Background(), p); err != nil && !strings.Contains(tc.name, "retries") {
				t.Errorf("DEL: %v", err)
			}
			e.assertClean(t, n)
		})
	}
}

// TestOneDevicePerMasterAndVLAN: a device still used by a live pod is a
// clear error; one left by a gone pod is removed.
func TestOneDevicePerMasterAndVLAN(t *testing.T) {
	e := newEnv(t, "1.1.0", enivlantest.CloudOptions{}, nil)
	ctx := context.Background()
	a, aNS, _ := e.bound(t, 700)
	if _, err := e.rt.Add(ctx, a); err != nil {
		t.Fatalf("ADD A: %v", err)
	}
	b, bNS, _ := e.bound(t, 700)
	_, err := e.rt.Add(ctx, b)
	if cniCode(err) != 11 || !strings.Contains(err.Error(), "VLAN 700 on master \"ens5\" is in use by pod default/"+a.Name) {
		t.Fatalf("ADD B while A holds VLAN 700: code %d %v", cniCode(err), err)
	}
	if n := len(harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network)); n != 1 {
		t.Fatalf("the refused ADD leaked: %d allocations", n)
	}
	// A is gone from the cloud's view (its endpoint deleted) but its DEL
	// has not run: B's ADD removes A's stale device.
	e.cloud.Agent.Remove(a.Namespace, a.Name)
	if _, err := e.rt.Add(ctx, b); err != nil {
		t.Fatalf("ADD B after A is gone: %v", err)
	}
	if harness.LinkExists(t, aNS, "eth0") {
		t.Error("A's stale device was not removed")
	}
	if !harness.LinkExists(t, bNS, "eth0") {
		t.Error("B has no link")
	}
	// A's late DEL succeeds and leaves B alone.
	if err := e.rt.Del(ctx, a); err != nil {
		t.Fatalf("late DEL A: %v", err)
	}
	if err := e.rt.Check(ctx, b); err != nil {
		t.Errorf("CHECK B after A's DEL: %v", err)
	}
	// Same pod, new sandbox: the old sandbox's device is stale.
	b2 := b
	b2.ContainerID = harness.ContainerID()
	b2NS := harness.NewNS(t, "pod")
	b2.NetNS = b2NS.Path()
	e.cloud.Bind(b2, enivlantest.Binding{VLAN: 700, MAC: harness.HardwareAddr(t, bNS, "eth0").String()})
	if _, err := e.rt.Add(ctx, b2); err != nil {
		t.Fatalf("ADD of B's new sandbox: %v", err)
	}
	if harness.LinkExists(t, bNS, "eth0") {
		t.Error("B's old sandbox device was not removed")
	}
	for _, p := range []harness.Pod{b, b2} {
		if err := e.rt.Del(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	e.assertClean(t, aNS, bNS, b2NS)
}

func TestStatusAndGC(t *testing.T) {
	e := newEnv(t, "1.1.0", enivlantest.CloudOptions{}, nil)
	ctx := context.Background()
	if err := e.rt.Status(ctx); err != nil {
		t.Fatalf("STATUS: %v", err)
	}
	e.cloud.Agent.SetHealthy(false)
	if err := e.rt.Status(ctx); cniCode(err) != 50 || !strings.Contains(err.Error(), "spiderpool-agent is not healthy") {
		t.Errorf("STATUS with an unhealthy agent: code %d %v", cniCode(err), err)
	}
	e.cloud.Agent.SetHealthy(true)

	p, n, _ := e.bound(t, 800)
	if _, err := e.rt.Add(ctx, p); err != nil {
		t.Fatal(err)
	}
	// A reservation nobody holds any more (a crashed runtime's leftover).
	stale := filepath.Join(e.cloud.IPAMDir, e.cloud.Network, "10.77.0.250")
	if err := os.WriteFile(stale, []byte("deadbeef\r\neth0"), 0o644); err != nil {
		t.Fatal(err)
	}
	// And an ownership record of a container the runtime no longer knows.
	staleRec := filepath.Join(e.cloud.StateDir, "ens5.4001.json")
	if err := os.WriteFile(staleRec, []byte(`{"master":"ens5","vlan":4001,"containerID":"deadbeef","ifName":"eth0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.rt.GC(ctx, p); err != nil {
		t.Fatalf("GC: %v", err)
	}
	if got := e.cloud.Records(); len(got) != 1 || got[0] != "ens5.800.json" {
		t.Errorf("records after GC: %v, want only the valid pod's", got)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Error("GC did not release the stale reservation")
	}
	if got := harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network); len(got) != 1 {
		t.Errorf("GC touched the valid attachment: %v", got)
	}
	if err := e.rt.Del(ctx, p); err != nil {
		t.Fatal(err)
	}
	e.assertClean(t, n)
}

func TestIPv6Preflight(t *testing.T) {
	t.Run("dual stack", func(t *testing.T) {
		e := newEnv(t, "1.1.0", enivlantest.CloudOptions{IPv6: true}, nil)
		p, n, _ := e.bound(t, 900)
		if _, err := e.rt.Add(context.Background(), p); err != nil {
			t.Fatalf("ADD: %v", err)
		}
		st, _ := inspect(t, n, "eth0")
		if len(st.addrs) != 2 || len(st.routes) != 2 {
			t.Errorf("addrs %v routes %v", st.addrs, st.routes)
		}
		logs, _ := os.ReadFile(e.log)
		if !strings.Contains(string(logs), "pre-flight ok") || !strings.Contains(string(logs), "family=ipv6") {
			t.Errorf("no IPv6 pre-flight in the log:\n%s", logs)
		}
		if err := e.rt.Check(context.Background(), p); err != nil {
			t.Errorf("CHECK: %v", err)
		}
		if err := e.rt.Del(context.Background(), p); err != nil {
			t.Fatal(err)
		}
		e.assertClean(t, n)
	})
	t.Run("ipv6 only, not bound: fails closed", func(t *testing.T) {
		e := newEnv(t, "1.1.0", enivlantest.CloudOptions{IPv6Only: true}, map[string]any{"validationTimeoutMs": 20})
		p, n := e.newPod(t)
		e.cloud.Bind(p, enivlantest.Binding{VLAN: 901, MAC: randomMAC(), NotEffective: true})
		_, err := e.rt.Add(context.Background(), p)
		if cniCode(err) != 11 || !strings.Contains(err.Error(), "no reply from gateway fd77::1 to IP fd77::") {
			t.Errorf("ADD: code %d %v", cniCode(err), err)
		}
		e.assertClean(t, n)
	})
	t.Run("ipv6 only, bound", func(t *testing.T) {
		e := newEnv(t, "1.0.0", enivlantest.CloudOptions{IPv6Only: true}, nil)
		p, n, _ := e.bound(t, 902)
		if _, err := e.rt.Add(context.Background(), p); err != nil {
			t.Fatalf("ADD: %v", err)
		}
		if err := e.rt.Del(context.Background(), p); err != nil {
			t.Fatal(err)
		}
		e.assertClean(t, n)
	})
}

// TestNoGatewaySkipsFamily: a family without a gateway is not probed, and
// the plugin says so; the ADD succeeds even though the fabric would drop.
func TestNoGatewaySkipsFamily(t *testing.T) {
	harness.RequireRoot(t)
	e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{
		"ipam": map[string]any{"type": "static", "addresses": []map[string]any{{"address": "10.77.0.50/24"}}},
	})
	p, n := e.newPod(t)
	e.cloud.Bind(p, enivlantest.Binding{VLAN: 950, MAC: randomMAC(), NotEffective: true, IPv4: "10.77.0.50/24"})
	if _, err := e.rt.Add(context.Background(), p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	logs, _ := os.ReadFile(e.log)
	if !strings.Contains(string(logs), "pre-flight skipped: no gateway") || !strings.Contains(string(logs), "skipped: IPAM result has no ipv4 gateway") {
		t.Errorf("the skip is not reported:\n%s", logs)
	}
	if err := e.rt.Del(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	e.assertClean(t, n)
}

// oldIPAM is an IPAM that, like spiderpool's, refuses cniVersion 1.1.0 and
// otherwise hands the call to host-local.
const oldIPAM = `#!/bin/sh
in=$(cat)
case "$in" in
*'"cniVersion":"1.1.0"'*)
  echo '{"cniVersion":"1.0.0","code":1,"msg":"incompatible CNI versions: this IPAM supports 0.3.0, 0.3.1, 0.4.0, 1.0.0"}'
  exit 1 ;;
esac
echo "$CNI_COMMAND" >> "$(dirname "$0")/calls"
IFS=:
for d in $CNI_PATH; do
  if [ -x "$d/host-local" ]; then printf '%s' "$in" | "$d/host-local"; exit $?; fi
done
exit 1
`

// TestIPAMGetsVersionItAccepts: with a 1.1.0 network, an IPAM that stops at
// 1.0.0 (spiderpool) still serves ADD, CHECK and DEL, and STATUS and GC do
// not fail on it.
func TestIPAMGetsVersionItAccepts(t *testing.T) {
	harness.RequireRoot(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "old-ipam"), []byte(oldIPAM), 0o755); err != nil {
		t.Fatal(err)
	}
	bins := []string{enivlantest.BuildSurrogate(t), harness.ReferencePlugins(t), dir}
	c := enivlantest.NewCloud(t, enivlantest.CloudOptions{})
	ipam := map[string]any{"type": "old-ipam"}
	for k, v := range c.IPAM {
		if k != "type" {
			ipam[k] = v
		}
	}
	rt := harness.NewRuntime(t, c.Node, bins, harness.ConfList(t, c.Network, "1.1.0", c.PluginConf(map[string]any{"ipam": ipam})))
	e := &env{cloud: c, rt: rt, ver: "1.1.0", log: filepath.Join(t.TempDir(), "log")}
	t.Setenv(enivlan.LogFileEnv, e.log)
	ctx := context.Background()
	p, n, _ := e.bound(t, 990)
	if _, err := rt.Add(ctx, p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	if err := rt.Check(ctx, p); err != nil {
		t.Errorf("CHECK: %v", err)
	}
	if err := rt.Status(ctx); err != nil {
		t.Errorf("STATUS: %v", err)
	}
	if err := rt.GC(ctx, p); err != nil {
		t.Errorf("GC: %v", err)
	}
	if err := rt.Del(ctx, p); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	calls, _ := os.ReadFile(filepath.Join(dir, "calls"))
	if got := strings.Fields(string(calls)); strings.Join(got, ",") != "ADD,CHECK,DEL" {
		t.Errorf("IPAM served %v, want ADD, CHECK, DEL", got)
	}
	e.assertClean(t, n)
}

// TestValidationOff: without validateIaasNetConfig nothing is probed, so an
// ADD succeeds even when the fabric would drop; the link is configured with
// the kernel announcing on up.
func TestValidationOff(t *testing.T) {
	e := newEnv(t, "1.0.0", enivlantest.CloudOptions{IPv6: true}, map[string]any{"validateIaasNetConfig": false})
	p, n := e.newPod(t)
	e.cloud.Bind(p, enivlantest.Binding{VLAN: 960, MAC: randomMAC(), NotEffective: true})
	if _, err := e.rt.Add(context.Background(), p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	st, _ := inspect(t, n, "eth0")
	if !st.up || len(st.addrs) != 2 || len(st.routes) != 2 {
		t.Errorf("link %+v", st)
	}
	var notify string
	n.MustDo(t, func() error {
		b, err := os.ReadFile("/proc/sys/net/ipv4/conf/eth0/arp_notify")
		notify = strings.TrimSpace(string(b))
		return err
	})
	if notify != "1" {
		t.Errorf("arp_notify = %q, want 1", notify)
	}
	if err := e.rt.Check(context.Background(), p); err != nil {
		t.Errorf("CHECK: %v", err)
	}
	if err := e.rt.Del(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	e.assertClean(t, n)
}

// TestLinkInContainer: with linkInContainer the master is looked up, and
// the link created, inside the pod netns.
func TestLinkInContainer(t *testing.T) {
	e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{"linkInContainer": true, "master": "ens6", "validateIaasNetConfig": false})
	p, n := e.newPod(t)
	harness.Veth(t, n, "ens6", e.cloud.Fabric, "fab1")
	e.cloud.Bind(p, enivlantest.Binding{VLAN: 970, MAC: randomMAC()})
	if _, err := e.rt.Add(context.Background(), p); err != nil {
		t.Fatalf("ADD: %v", err)
	}
	st, ok := inspect(t, n, "eth0")
	if !ok || !st.up || st.kind != "macvlan" || len(st.addrs) != 1 {
		t.Errorf("link %+v (found %v)", st, ok)
	}
	if err := e.rt.Check(context.Background(), p); err != nil {
		t.Errorf("CHECK: %v", err)
	}
	if err := e.rt.Del(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	if harness.LinkExists(t, n, "eth0") {
		t.Error("DEL left eth0")
	}
	if a := harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network); len(a) > 0 {
		t.Errorf("allocations left: %v", a)
	}
}

// TestInterfaceExists: ADD fails when CNI_IFNAME already exists in the pod
// netns, and leaves neither the temporary link nor the allocation behind.
func TestInterfaceExists(t *testing.T) {
	e := newEnv(t, "1.1.0", enivlantest.CloudOptions{}, nil)
	p, n, _ := e.bound(t, 980)
	harness.Veth(t, n, "eth0", e.cloud.Fabric, "fabx")
	_, err := e.rt.Add(context.Background(), p)
	if err == nil || !strings.Contains(err.Error(), `to "eth0"`) {
		t.Fatalf("ADD over an existing eth0: %v", err)
	}
	if l := enivlantest.Links(t, n); len(l) != 1 || l[0] != "eth0:veth" {
		t.Errorf("pod links: %v, want only the pre-existing eth0", l)
	}
	if a := harness.Allocations(t, e.cloud.IPAMDir, e.cloud.Network); len(a) > 0 {
		t.Errorf("allocations left: %v", a)
	}
	if r := e.cloud.Records(); len(r) > 0 {
		t.Errorf("records left: %v", r)
	}
}
