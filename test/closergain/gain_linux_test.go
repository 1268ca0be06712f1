package closergain

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/meshcni/meshcnitest"
	"aether.io/node/pkg/sockcloser/sockclosertest"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// side is one kind of timed ADD: a plugin build and a scenario.
type side struct {
	// name prefixes the side's metrics.
	name string
	// add runs one attachment in a fresh pod netns and returns how long
	// the timed ADD took and its plugin processes' CPU time.
	add func(b *testing.B) (wall, cpu time.Duration)
}

// BenchmarkCloserGain: each of b.N rounds runs one exec'd ADD of every side
// below in a random order, each in a fresh pod netns, DEL untimed after it
// (the setup of BenchmarkEniVlanExecAdd's and BenchmarkMeshExecAdd's ours):
//
//   - enivlan: eni-vlan (surrogate link, validation on: the ARP pre-flight's
//     packet sockets go to the closer) with static IPAM;
//   - aethercni: aether-cni's fresh ADD (no commit removes anything, so no
//     closer is started: a control whose gain should be nil);
//   - aethercni-retry: aether-cni's ADD of a sandbox whose first ADD
//     excluded two ports more (the divert's edit deletes their rules, and
//     the netfilter socket of that commit goes to the closer);
//
// each as built for release and as built with sockclosertest.OffTag
// (suffix -off). It reports every side's p50-ns and cpu-p50-ns, and per
// plugin scenario gain-p50-ns: the median over rounds of the -off ADD
// minus the one with the closer, in the same round.
func BenchmarkCloserGain(b *testing.B) {
	harness.RequireRoot(b)
	// The plugins' default level, as deployed.
	b.Setenv(enivlan.LogLevelEnv, "warn")
	var sides []side
	for _, off := range []bool{false, true} {
		sides = append(sides, eniVlan(b, off))
	}
	agent := meshcnitest.ServeAgent(b, b.TempDir())
	for _, off := range []bool{false, true} {
		sides = append(sides, aetherCNI(b, agent, off, false), aetherCNI(b, agent, off, true))
	}
	for _, s := range sides { // warm the page cache and the agents
		s.add(b)
	}
	wall := make(map[string][]time.Duration, len(sides))
	cpu := make(map[string][]time.Duration, len(sides))
	b.ResetTimer()
	for range b.N {
		for _, i := range rand.Perm(len(sides)) {
			s := sides[i]
			w, c := s.add(b)
			wall[s.name] = append(wall[s.name], w)
			cpu[s.name] = append(cpu[s.name], c)
		}
	}
	b.StopTimer()
	for _, s := range sides {
		b.ReportMetric(float64(median(wall[s.name])), s.name+"-p50-ns")
		b.ReportMetric(float64(median(cpu[s.name])), s.name+"-cpu-p50-ns")
	}
	for _, name := range []string{"enivlan", "aethercni", "aethercni-retry"} {
		with, without := wall[name], wall[name+"-off"]
		gain := make([]time.Duration, len(with))
		for i := range with {
			gain[i] = without[i] - with[i]
		}
		b.ReportMetric(float64(median(gain)), name+"-gain-p50-ns")
	}
}

// median returns the median of d.
func median(d []time.Duration) time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// tags are the build tags of a plugin, with off: sockclosertest.OffTag.
func tags(off bool, base ...string) []string {
	if off {
		return append(base, sockclosertest.OffTag)
	}
	return base
}

// suffix names a side built with off.
func suffix(off bool) string {
	if off {
		return "-off"
	}
	return ""
}

// eniVlan is eni-vlan's side in a cloud of its own.
func eniVlan(b *testing.B, off bool) side {
	bin := harness.BuildRelease(b, "./cmd/eni-vlan", tags(off, enivlantest.SurrogateTag)...)
	static := harness.BuildRelease(b, harness.ReferencePluginsModule+"/plugins/ipam/static")
	c := enivlantest.NewCloud(b, enivlantest.CloudOptions{})
	ex := harness.NewRSSExec()
	conf := harness.ConfList(b, c.Network, "1.1.0", c.PluginConf(map[string]any{"ipam": enivlantest.StaticIPAM()}))
	rt := harness.NewRuntimeExec(b, c.Node, []string{filepath.Dir(bin), filepath.Dir(static)}, conf, ex)
	mac := net.HardwareAddr{0x02, 0x00, 0x0a, 0x4d, 0x00, 0x3c}.String()
	return side{name: "enivlan" + suffix(off), add: func(b *testing.B) (time.Duration, time.Duration) {
		return timedAdd(b, rt, ex, nil, func(p harness.Pod) {
			c.Bind(p, enivlantest.Binding{VLAN: 100, MAC: mac, IPv4: enivlantest.BenchIP})
		})
	}}
}

// aetherCNI is aether-cni's side, chained onto meshcnitest.PrevResult
// against the agent at socket; with retry, each timed ADD follows a first
// ADD of the same sandbox whose divert excluded two ports more.
func aetherCNI(b *testing.B, socket string, off, retry bool) side {
	bin := harness.BuildRelease(b, "./cmd/aether-cni", tags(off)...)
	pins := filepath.Join(b.TempDir(), "pins")
	conf := func(ports ...int) []byte {
		return harness.ConfList(b, "bench", "1.0.0", map[string]any{
			"type": "aether-cni", "agent_socket": socket,
			"netns_pin_dir": pins, "netns_unpin_delay_seconds": 0, "cri_socket": "",
			"readiness_probe_disabled": true,
			"capture":                  map[string]any{"redirect_all": true, "exclude_ports": ports},
			"prevResult":               json.RawMessage(meshcnitest.PrevResult),
		})
	}
	dirs := []string{filepath.Dir(bin)}
	ex := harness.NewRSSExec()
	rt := harness.NewRuntimeExec(b, nil, dirs, conf(22), ex)
	name := "aethercni"
	var first *harness.Runtime
	if retry {
		name += "-retry"
		first = harness.NewRuntimeExec(b, nil, dirs, conf(22, 80, 443), harness.NewRSSExec())
	}
	return side{name: name + suffix(off), add: func(b *testing.B) (time.Duration, time.Duration) {
		return timedAdd(b, rt, ex, first, nil)
	}}
}

// timedAdd runs one attachment through rt in a fresh pod netns (bind, if
// set, prepares it; first, if set, adds it once before) and returns how
// long rt's ADD took and its plugin processes' CPU time; DEL follows,
// untimed.
func timedAdd(b *testing.B, rt *harness.Runtime, ex *harness.RSSExec, first *harness.Runtime, bind func(harness.Pod)) (time.Duration, time.Duration) {
	ctx := context.Background()
	n, err := harness.CreateNS("pod")
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = n.Remove() }()
	p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: n.Path(), Name: "bench", Namespace: "default", UID: "u"}
	if bind != nil {
		bind(p)
	}
	if first != nil {
		if _, err := first.Add(ctx, p); err != nil {
			b.Fatalf("first ADD: %v", err)
		}
	}
	ex.CPU()
	start := time.Now()
	_, err = rt.Add(ctx, p)
	wall := time.Since(start)
	cpu := ex.CPU()
	if err != nil {
		b.Fatalf("ADD: %v", err)
	}
	if err := rt.Del(ctx, p); err != nil {
		b.Fatalf("DEL: %v", err)
	}
	return wall, cpu
}
