package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/google/nftables"

	"aether.io/node/meshcni/e2e/agentproc"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// env is one node: a node netns with the bridge, the agent, a pin dir and a
// libcni runtime over bridge + host-local → aether-cni.
type env struct {
	node    *harness.NS
	agent   *agentproc.Agent
	pinDir  string
	rt      *harness.Runtime
	ver     string
	mesh    map[string]any
	ownBins string
}

// addMeshOnly re-runs aether-cni's ADD alone with prev as prevResult, as a
// runtime's retried ADD reaches it (the reference bridge plugin does not
// support a second ADD of the same container, so the chain is not re-run).
func (e *env) addMeshOnly(ctx context.Context, p harness.Pod, prev types.Result) error {
	conf := map[string]any{"cniVersion": e.ver, "name": "meshnet"}
	for k, v := range e.mesh {
		conf[k] = v
	}
	delete(conf, "capabilities")
	if p.CapabilityArgs != nil {
		conf["runtimeConfig"] = p.CapabilityArgs
	}
	prevVer, err := prev.GetAsVersion(e.ver)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := prevVer.PrintTo(&buf); err != nil {
		return err
	}
	conf["prevResult"] = json.RawMessage(buf.Bytes())
	stdin, err := json.Marshal(conf)
	if err != nil {
		return err
	}
	rc := p.RuntimeConf()
	var kv []string
	for _, a := range rc.Args {
		kv = append(kv, a[0]+"="+a[1])
	}
	bin := filepath.Join(e.ownBins, "aether-cni")
	return e.node.Do(func() error {
		_, err := invoke.ExecPluginWithResult(ctx, bin, stdin, &invoke.Args{
			Command: "ADD", ContainerID: rc.ContainerID, NetNS: rc.NetNS, IfName: rc.IfName,
			PluginArgsStr: strings.Join(kv, ";"), Path: filepath.Dir(bin),
		}, nil)
		return err
	})
}

const (
	podSubnet4  = "10.250.0.0/24"
	podSubnet6  = "fd10:250::/64"
	gw4         = "10.250.0.1"
	gw6         = "fd10:250::1"
	exclSubnet4 = "10.250.9.0/24"
	exclSubnet6 = "fd10:99::/64"
)

func newEnv(t *testing.T, ver string, meshConf map[string]any) *env {
	t.Helper()
	harness.RequireRoot(t)
	node := harness.NewNS(t, "node")
	agent := agentproc.Start(t, node)
	pinDir := filepath.Join(t.TempDir(), "pins")
	t.Cleanup(func() {
		// Nothing may stay mounted under the test's temp dir.
		names, _ := os.ReadDir(pinDir)
		for _, n := range names {
			_ = syscall.Unmount(filepath.Join(pinDir, n.Name()), syscall.MNT_DETACH)
		}
	})
	ipam, _ := harness.HostLocalIPAM(t, podSubnet4, podSubnet6)
	ipam["routes"] = []map[string]string{{"dst": "0.0.0.0/0"}, {"dst": "::/0"}}
	mesh := map[string]any{
		"type": "aether-cni", "agent_socket": agent.Sock, "netns_pin_dir": pinDir,
		"netns_unpin_delay_seconds": 0, "cri_socket": "", "agent_timeout_ms": 3000,
		"capabilities": map[string]bool{"io.kubernetes.cri.pod-annotations": true},
		"log_file":     filepath.Join(agent.Dir, "cni.log"), "log_level": "debug",
	}
	for k, v := range meshConf {
		mesh[k] = v
	}
	conf := harness.ConfList(t, "meshnet", ver,
		map[string]any{"type": "bridge", "bridge": "aetbr0", "isGateway": true, "ipam": ipam},
		mesh)
	bins := []string{harness.BuildOwn(t, "aether-cni", "aether-agent"), harness.ReferencePlugins(t)}
	return &env{node: node, agent: agent, pinDir: pinDir, rt: harness.NewRuntime(t, node, bins, conf), ver: ver, mesh: mesh, ownBins: bins[0]}
}

func newPod(t *testing.T, name string) (harness.Pod, *harness.NS) {
	ns := harness.NewNS(t, "pod")
	return harness.Pod{ContainerID: harness.ContainerID(), NetNS: ns.Path(), Name: name, Namespace: "shop", UID: "uid-" + name}, ns
}

func cniCode(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// tablePresent reads the pod netns for the capture table.
func tablePresent(t *testing.T, ns *harness.NS) bool {
	t.Helper()
	ok, err := (capture.Installer{}).Present(ns.Path())
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

// deleteLastDivertRule removes a rule by hand, as an operator or another
// agent might.
func deleteLastDivertRule(t *testing.T, ns *harness.NS) {
	t.Helper()
	ns.MustDo(t, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		tbl := &nftables.Table{Name: capture.TableName, Family: nftables.TableFamilyINet}
		rules, err := c.GetRules(tbl, &nftables.Chain{Name: "divert", Table: tbl})
		if err != nil {
			return err
		}
		if len(rules) == 0 {
			return fmt.Errorf("divert chain empty")
		}
		if err := c.DelRule(rules[len(rules)-1]); err != nil {
			return err
		}
		return c.Flush()
	})
}

func settle(t *testing.T, nss ...*harness.NS) {
	t.Helper()
	for _, n := range nss {
		capturetest.WaitAddrsSettled(t, n)
	}
}

// checkCloserTook makes t fail unless the plugin log at path says that the
// socket closer took a netfilter socket exactly want times so far, and
// never that the plugin closed one itself.
func checkCloserTook(t *testing.T, path string, want int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("netfilter socket closed in the plugin")) {
		t.Errorf("the plugin closed a netfilter socket itself:\n%s", b)
	}
	if got := bytes.Count(b, []byte("netfilter socket handed to the socket closer")); got != want {
		t.Errorf("the socket closer took %d netfilter sockets, want %d", got, want)
	}
}

// waitNoCloser waits until no aether-cni socket closer runs in node's netns
// (it exits once the plugin has exited and the socket it holds is
// released); the test's deadline bounds the wait.
func waitNoCloser(t *testing.T, node *harness.NS) {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(node.Path(), &st); err != nil {
		t.Fatal(err)
	}
	netns := fmt.Sprintf("net:[%d]", st.Ino)
	for {
		procs, err := os.ReadDir("/proc")
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, p := range procs {
			cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
			if err != nil || string(cmd) != capture.CloserName+"\x00" {
				continue
			}
			if ns, err := os.Readlink(filepath.Join("/proc", p.Name(), "ns", "net")); err == nil && ns == netns {
				found = true
			}
		}
		if !found {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}
