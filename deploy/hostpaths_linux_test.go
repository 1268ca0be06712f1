package deploy_test

import (
	"bytes"
	"encoding/json"
	"maps"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"aether.io/node/agent/app"
	"aether.io/node/cniinstall"
	"aether.io/node/csi"
	"aether.io/node/meshcni"
	"aether.io/node/pkg/flowapi"
	"aether.io/node/pkg/meshcontract"
)

// hostPathKeys are the keys of hostPaths in the chart's values.yaml.
func hostPathKeys(t *testing.T) []string {
	t.Helper()
	keys := slices.Sorted(maps.Keys(readValues(t).HostPaths))
	if len(keys) == 0 {
		t.Fatal("values.yaml has no hostPaths")
	}
	return keys
}

// seenAt returns the host path container c reaches at path: the host
// path of the hostPath volume mounted over path, joined with the rest of
// path. It fails when path is not on a hostPath volume in c.
func seenAt(t *testing.T, r *render, c corev1.Container, path string) string {
	t.Helper()
	m, v := mountOf(t, r, c, path)
	if v.HostPath == nil {
		t.Fatalf("container %s reaches %s through volume %s, which is not a host path", c.Name, path, v.Name)
	}
	rel, err := filepath.Rel(m.MountPath, path)
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(v.HostPath.Path, rel)
}

// TestHostPaths checks every value set against its hostPaths: each path
// flag of each binary lies in the directory its value names and is the
// same host path inside the container (the paths the binaries hand each
// other, such as the agent socket in the chained conflist, a pod's netns
// pin or a UDS socket, are host paths), and every hostPath volume is one of
// the values or lies inside one.
func TestHostPaths(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		hp := chartValues(t, r).HostPaths
		run, state, kubelet := hp["runDir"], hp["stateDir"], hp["kubeletDir"]
		socketDir, proxyDir := filepath.Join(run, "agent"), filepath.Join(run, "proxy")
		// sameOnHost checks c reaches each path at the same host path.
		sameOnHost := func(c corev1.Container, paths ...string) {
			t.Helper()
			for _, p := range paths {
				if got := seenAt(t, r, c, p); got != p {
					t.Errorf("container %s: %s is host path %s, want the same path", c.Name, p, got)
				}
			}
		}

		agent := container(t, r, "aether-agent")
		cfg := agentConfig(t, r)
		want := map[string]string{cfg.CNISocket: socketDir, cfg.AdminSocket: socketDir, cfg.XDSSocket: proxyDir, cfg.LDSSocket: proxyDir}
		if cfg.WorkloadAPISocket != "" && slices.ContainsFunc(agent.Args, func(a string) bool { return strings.HasPrefix(a, "--workload-api-socket=") }) {
			want[cfg.WorkloadAPISocket] = proxyDir
		}
		sockets := slices.Sorted(maps.Keys(want))
		for _, s := range sockets {
			if filepath.Dir(s) != want[s] {
				t.Errorf("aether-agent socket %s: want it in %s (hostPaths.runDir/agent for its own, runDir/proxy for the proxy's)", s, want[s])
			}
		}
		if cfg.StateDir != state || cfg.UDSRoot != filepath.Join(run, "uds") {
			t.Errorf("aether-agent --state-dir %s --uds-csi-root %s: want hostPaths.stateDir %s and %s/uds", cfg.StateDir, cfg.UDSRoot, state, run)
		}
		sameOnHost(agent, append(slices.Clone(sockets), cfg.StateDir, cfg.UDSRoot)...)

		// The installer writes agent_socket and netns_pin_dir into the
		// conflist that aether-cni reads on the host.
		installer := container(t, r, "install-cni")
		o := installerOptions(t, r)
		var entry struct {
			AgentSocket string `json:"agent_socket"`
			PinDir      string `json:"netns_pin_dir"`
		}
		if err := json.Unmarshal(o.Config.Entry, &entry); err != nil {
			t.Fatal(err)
		}
		pinDir := filepath.Join(run, "netns")
		if entry.AgentSocket != cfg.CNISocket || entry.PinDir != pinDir {
			t.Errorf("chained entry agent_socket %q netns_pin_dir %q: want the agent's --cni-socket %s and %s", entry.AgentSocket, entry.PinDir, cfg.CNISocket, pinDir)
		}
		if o.Config.StateFile != filepath.Join(state, "cni-install", "state.json") {
			t.Errorf("installer --state-file %s: want it in hostPaths.stateDir %s", o.Config.StateFile, state)
		}
		sameOnHost(installer, o.Config.StateFile)
		for _, d := range []struct{ dir, key string }{{o.Config.BinDir, "cniBinDir"}, {o.Config.ConfDir, "cniConfDir"}} {
			if got := seenAt(t, r, installer, d.dir); got != hp[d.key] {
				t.Errorf("installer dir %s is host path %s, want hostPaths.%s %s", d.dir, got, d.key, hp[d.key])
			}
		}

		// The proxy dials the agent's sockets and opens the pins and the
		// UDS sockets the agent hands it (host paths); pins are bind
		// mounts made after the proxy started, so they must propagate.
		proxy := container(t, r, "aether-proxy")
		var dialed []string
		for _, a := range expand(proxy.Args) {
			flag, v, _ := strings.Cut(a, "=")
			switch flag {
			case "-xds-address", "-lds-address":
				dialed = append(dialed, strings.TrimPrefix(v, "unix://"))
			case "-workload-api-socket":
				dialed = append(dialed, v)
			}
		}
		if len(dialed) < 2 {
			t.Fatalf("aether-proxy args %q: want -xds-address and -lds-address", proxy.Args)
		}
		for _, s := range dialed {
			if !slices.Contains(sockets, s) {
				t.Errorf("aether-proxy dials %s, which the agent does not serve (%q)", s, sockets)
			}
			if filepath.Dir(s) != proxyDir {
				t.Errorf("aether-proxy dials %s: want only sockets in %s, the directory it mounts", s, proxyDir)
			}
		}
		sameOnHost(proxy, append(dialed, pinDir, cfg.UDSRoot)...)
		// It serves the flows socket in a directory of its own, which
		// aetherctl on the node reaches at the same path.
		var flows string
		for _, a := range expand(proxy.Args) {
			if s, ok := strings.CutPrefix(a, "-flows-socket="); ok {
				flows = s
			}
		}
		if filepath.Dir(flows) != filepath.Join(run, "proxy-flows") {
			t.Errorf("aether-proxy -flows-socket %q: want it in %s/proxy-flows, its own directory", flows, run)
		} else {
			sameOnHost(proxy, flows)
		}
		// An app's UDS socket belongs to the app's user, mode by its umask
		// (0755 typically): root connects to it only with DAC_OVERRIDE;
		// without it every UDS delivery falls back to TCP.
		if sc := proxy.SecurityContext; sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Add, corev1.Capability("DAC_OVERRIDE")) {
			t.Errorf("aether-proxy lacks CAP_DAC_OVERRIDE: it cannot connect to app UDS sockets under %s", cfg.UDSRoot)
		}
		if m, _ := mountOf(t, r, proxy, filepath.Join(pinDir, "pin")); m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
			t.Errorf("aether-proxy mounts the pins (%s) without HostToContainer propagation: %+v", pinDir, m)
		}

		if c, ok := findContainer(r, "aether-csi"); ok {
			var stderr bytes.Buffer
			ccfg, err := csi.ParseFlags(expand(c.Args), &stderr)
			if err != nil {
				t.Fatalf("aether-csi rejects the chart's args: %v\n%s", err, stderr.String())
			}
			if ccfg.KubeletDir != kubelet || ccfg.Root != cfg.UDSRoot {
				t.Errorf("aether-csi --kubelet-dir %s --uds-csi-root %s: want hostPaths.kubeletDir %s and the agent's %s", ccfg.KubeletDir, ccfg.Root, kubelet, cfg.UDSRoot)
			}
			paths := []string{ccfg.KubeletDir, ccfg.Root}
			if ccfg.RegistrationDir != "" {
				paths = append(paths, ccfg.Endpoint, ccfg.RegistrationDir)
			}
			sameOnHost(c, paths...)
		}
		if c, ok := findContainer(r, "csi-node-driver-registrar"); ok {
			want := "--kubelet-registration-path=" + filepath.Join(kubelet, "plugins", meshcontract.CSIDriver, "csi.sock")
			if !slices.Contains(c.Args, want) {
				t.Errorf("csi-node-driver-registrar args %q lack %s", c.Args, want)
			}
		}

		// Every hostPath volume is a value or lies inside one.
		var values []string
		for _, k := range hostPathKeys(t) {
			values = append(values, hp[k])
		}
		for _, a := range expand(proxy.Args) {
			if s, ok := strings.CutPrefix(a, "-spire-admin-socket="); ok {
				values = append(values, filepath.Dir(s))
			}
		}
		for _, v := range r.ds.Spec.Template.Spec.Volumes {
			if v.HostPath == nil {
				continue
			}
			if !slices.ContainsFunc(values, func(p string) bool { return v.HostPath.Path == p || strings.HasPrefix(v.HostPath.Path, p+"/") }) {
				t.Errorf("volume %s mounts host path %s, which is none of the hostPaths %q", v.Name, v.HostPath.Path, values)
			}
		}
	})
}

// TestHostPathDefaults checks the chart's default hostPaths are the
// binaries' defaults, so aetherctl, a hand-written aether-cni entry and the
// static conflist work on a node installed with the defaults.
func TestHostPathDefaults(t *testing.T) {
	hp := readValues(t).HostPaths
	def, err := app.ParseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, chart, binary string }{
		{"runDir/agent: aether-agent's socket dir", filepath.Join(hp["runDir"], "agent"), app.SocketDir},
		{"runDir/agent/cni.sock: aether-cni's agent_socket", filepath.Join(hp["runDir"], "agent", "cni.sock"), meshcni.DefaultAgentSocket},
		{"runDir/netns: aether-cni's netns_pin_dir", filepath.Join(hp["runDir"], "netns"), meshcni.DefaultPinDir},
		{"runDir/uds: --uds-csi-root", filepath.Join(hp["runDir"], "uds"), meshcontract.DefaultUDSCSIRoot},
		{"runDir/proxy-flows/flows.sock: aether-proxy's -flows-socket, aetherctl flows' --socket", filepath.Join(hp["runDir"], "proxy-flows", "flows.sock"), flowapi.DefaultSocket},
		{"stateDir: aether-agent's --state-dir", hp["stateDir"], def.StateDir},
		{"stateDir: the installer's --state-file", filepath.Join(hp["stateDir"], "cni-install", "state.json"), cniinstall.DefaultStateFile},
		{"cniBinDir: the installer's --cni-bin-dir", hp["cniBinDir"], cniinstall.DefaultBinDir},
		{"cniConfDir: the installer's --cni-conf-dir", hp["cniConfDir"], cniinstall.DefaultConfDir},
		{"kubeletDir: aether-csi's --kubelet-dir", hp["kubeletDir"], csi.DefaultKubeletDir},
	} {
		if c.chart != c.binary {
			t.Errorf("%s: chart default %s, binary default %s", c.name, c.chart, c.binary)
		}
	}
}

// TestHostPathsMoved renders the k3s value set, which sets every hostPaths
// value to a path other than its default: no default host path may be left
// anywhere in the render (args, mounts, volumes, comments), neither as a
// path nor as the directory of one.
func TestHostPathsMoved(t *testing.T) {
	defaults := readValues(t).HostPaths
	set := valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == "k3s" })]
	hp := readValues(t, set.paths()...).HostPaths
	r := renderSet(t, set)
	for _, k := range hostPathKeys(t) {
		def := defaults[k]
		if hp[k] == def {
			t.Errorf("value set %s keeps hostPaths.%s at its default %s: it must move every host path", set.name, k, def)
			continue
		}
		// def as a path of its own or a prefix of one, not as the tail of
		// another path (k3s's .../agent/etc/cni/net.d) or the head of a
		// longer name (/run/aether-node).
		re := regexp.MustCompile(`(^|[^A-Za-z0-9._+@-])` + regexp.QuoteMeta(def) + `($|[^A-Za-z0-9._+@-])`)
		for i, line := range strings.Split(string(r.raw), "\n") {
			if re.MatchString(line) {
				t.Errorf("the render of %s still names the default hostPaths.%s %s, line %d: %s", set.name, k, def, i+1, line)
			}
		}
	}
}
