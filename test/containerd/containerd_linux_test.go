package containerd_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/meshcni/capture"
	"aether.io/node/meshcni/e2e/agentproc"
	"aether.io/node/test/harness"
	"aether.io/node/tools/image/oci"
)

func TestMain(m *testing.M) { harness.Main(m) }

const pauseImage = "registry.k8s.io/pause:3.9"

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func goBuild(t *testing.T, out string, pkg string) {
	t.Helper()
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = harness.ModuleRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
}

func need(t *testing.T, bins ...string) {
	t.Helper()
	for _, b := range bins {
		if _, err := exec.LookPath(b); err != nil {
			t.Fatalf("the containerd lane needs %s (Debian: apt-get install containerd runc): %v", b, err)
		}
	}
}

// runtime is one containerd instance with its own root, state, sockets,
// runc root, CNI dirs and cgroup parent, running inside node.
type runtime struct {
	base, sock, cgroupParent string
	cmd                      *exec.Cmd
	done                     chan error
	cri                      runtimeapi.RuntimeServiceClient
	conn                     *grpc.ClientConn
}

// startContainerd starts containerd in node with the conflist conf(its CRI
// socket) and waits until CRI reports RuntimeReady and NetworkReady.
func startContainerd(t *testing.T, node *harness.NS, cniBin string, conf func(criSock string) string) *runtime {
	t.Helper()
	base, err := os.MkdirTemp("", "aet-ctd-")
	if err != nil {
		t.Fatal(err)
	}
	r := &runtime{base: base, sock: filepath.Join(base, "containerd.sock"), cgroupParent: "/aet-ctd-" + randHex(4)}
	// Registered first, so it runs last: after containerd stopped.
	t.Cleanup(func() { r.cleanupHost(t) })
	for _, d := range []string{"cni/conf", "root", "state", "runc"} {
		if err := os.MkdirAll(filepath.Join(base, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(base, "cni/conf/10-mesh.conflist"), []byte(conf(r.sock)), 0o600); err != nil {
		t.Fatal(err)
	}
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = %q
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
    max_conf_num = 1
`, filepath.Join(base, "root"), filepath.Join(base, "state"), r.sock, r.sock+".ttrpc", pauseImage,
		filepath.Join(base, "runc"), cniBin, filepath.Join(base, "cni/conf"))
	cfgPath := filepath.Join(base, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(base, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() })
	cmd := exec.Command("containerd", "--config", cfgPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	// containerd (and the CNI plugins it runs, and its shims) live in the
	// node netns: the bridge never touches the machine's own network.
	if err := node.Do(cmd.Start); err != nil {
		t.Fatalf("failed to start containerd: %v", err)
	}
	r.cmd, r.done = cmd, make(chan error, 1)
	go func() { r.done <- cmd.Wait() }()
	t.Cleanup(func() { r.stop(t) })

	r.conn, err = grpc.NewClient("unix://"+r.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.conn.Close() })
	r.cri = runtimeapi.NewRuntimeServiceClient(r.conn)
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := r.cri.Status(ctx, &runtimeapi.StatusRequest{})
		cancel()
		if err == nil && allTrue(st.GetStatus().GetConditions()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd CRI not ready: %v %v\n%s", err, st.GetStatus(), r.log())
		}
		select {
		case err := <-r.done:
			t.Fatalf("containerd exited: %v\n%s", err, r.log())
		case <-time.After(50 * time.Millisecond):
		}
	}
	return r
}

func allTrue(cs []*runtimeapi.RuntimeCondition) bool {
	for _, c := range cs {
		if !c.GetStatus() {
			return false
		}
	}
	return len(cs) > 0
}

func (r *runtime) log() string {
	b, _ := os.ReadFile(filepath.Join(r.base, "containerd.log"))
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return string(b)
}

// stop removes every sandbox left (so shims and pause processes end with
// containerd's knowledge), then stops containerd.
func (r *runtime) stop(t *testing.T) {
	if r.cmd == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if l, err := r.cri.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err == nil {
		for _, s := range l.GetItems() {
			_, _ = r.cri.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.GetId()})
			_, _ = r.cri.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.GetId()})
		}
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		_ = r.cmd.Process.Kill()
		<-r.done
	}
	r.cmd = nil
}

// cleanupHost removes what an instance leaves outside its base dir, also
// after a crash: runc containers, mounts under base, its cgroups, the shim
// socket dir when empty, and base itself.
func (r *runtime) cleanupHost(t *testing.T) {
	runcRoot := filepath.Join(r.base, "runc", "k8s.io")
	if out, err := exec.Command("runc", "--root", runcRoot, "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_ = exec.Command("runc", "--root", runcRoot, "delete", "--force", id).Run()
		}
	}
	if f, err := os.Open("/proc/self/mountinfo"); err == nil {
		var mounts []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if fs := strings.Fields(sc.Text()); len(fs) > 4 && strings.HasPrefix(fs[4], r.base+"/") {
				mounts = append(mounts, fs[4])
			}
		}
		f.Close()
		for i := len(mounts) - 1; i >= 0; i-- {
			_ = syscall.Unmount(mounts[i], syscall.MNT_DETACH)
		}
	}
	ctrls, _ := os.ReadDir("/sys/fs/cgroup")
	for _, c := range ctrls {
		dir := filepath.Join("/sys/fs/cgroup", c.Name(), r.cgroupParent)
		// Children first (one level: the sandbox cgroups).
		subs, _ := os.ReadDir(dir)
		for _, s := range subs {
			if s.IsDir() {
				_ = syscall.Rmdir(filepath.Join(dir, s.Name()))
			}
		}
		_ = syscall.Rmdir(dir)
	}
	_ = syscall.Rmdir("/run/containerd/s")
	_ = syscall.Rmdir("/run/containerd")
	if err := os.RemoveAll(r.base); err != nil {
		t.Errorf("failed to remove %s: %v", r.base, err)
	}
}

// sandboxNetns returns the network namespace path containerd gave a sandbox.
func (r *runtime) sandboxNetns(t *testing.T, id string) string {
	t.Helper()
	st, err := r.cri.PodSandboxStatus(context.Background(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	var info struct {
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string }
			}
		} `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(st.GetInfo()["info"]), &info); err != nil {
		t.Fatalf("sandbox info: %v", err)
	}
	for _, n := range info.RuntimeSpec.Linux.Namespaces {
		if n.Type == "network" && n.Path != "" {
			return n.Path
		}
	}
	t.Fatalf("sandbox %s has no network namespace path", id)
	return ""
}

// cniCalls counts aether-cni's log lines with msg.
func cniCalls(t *testing.T, logFile, msg string) int {
	t.Helper()
	f, err := os.Open(logFile)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, _ := io.ReadAll(f)
	return strings.Count(string(b), `msg="`+msg+`"`)
}

// TestRunPodSandboxThroughConflist: containerd runs a pod sandbox through
// bridge + host-local → aether-cni with the real aether-agent; the managed
// pod gets its capture divert, its pin and its agent record; StopPodSandbox
// and RemovePodSandbox (the second DEL, with an empty CNI_NETNS) withdraw it.
func TestRunPodSandboxThroughConflist(t *testing.T) {
	harness.RequireRoot(t)
	need(t, "containerd", "runc", "ctr")
	node := harness.NewNS(t, "ctdnode")
	agent := agentproc.Start(t, node)

	// CNI bin dir: the reference plugins, loopback (containerd sets up lo
	// with it) and our plugin.
	cniBin := t.TempDir()
	ref := harness.ReferencePlugins(t)
	own := harness.BuildOwn(t, "aether-cni", "aether-agent")
	for _, p := range []string{filepath.Join(ref, "bridge"), filepath.Join(ref, "host-local"), filepath.Join(own, "aether-cni")} {
		if err := os.Symlink(p, filepath.Join(cniBin, filepath.Base(p))); err != nil {
			t.Fatal(err)
		}
	}
	goBuild(t, cniBin+"/", "github.com/containernetworking/plugins/plugins/main/loopback")

	// The pause image, built here and imported: nothing is pulled.
	imgDir := t.TempDir()
	goBuild(t, filepath.Join(imgDir, "pause"), "./test/containerd/pause")
	pause, err := oci.Build(oci.Spec{
		Files:      []oci.File{{Path: "/pause", Source: filepath.Join(imgDir, "pause"), Mode: 0o755}},
		Entrypoint: []string{"/pause"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := oci.WriteTarball(filepath.Join(imgDir, "pause.tar"), pause, pauseImage); err != nil {
		t.Fatal(err)
	}

	pinDir := filepath.Join(t.TempDir(), "pins")
	t.Cleanup(func() {
		names, _ := os.ReadDir(pinDir)
		for _, n := range names {
			_ = syscall.Unmount(filepath.Join(pinDir, n.Name()), syscall.MNT_DETACH)
		}
	})
	logFile := filepath.Join(t.TempDir(), "aether-cni.log")
	ipamDir := filepath.Join(t.TempDir(), "ipam")
	bridge := "aetcb" + randHex(4)
	subnet := fmt.Sprintf("10.%d.%d.0/24", 200+int(randHex(1)[0])%50, int(randHex(1)[1])%250)
	conf := func(criSock string) string {
		b, _ := json.Marshal(map[string]any{
			"cniVersion": "1.0.0", "name": "meshnet",
			"plugins": []map[string]any{
				{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": map[string]any{
					"type": "host-local", "ranges": [][]map[string]string{{{"subnet": subnet}}},
					"routes": []map[string]string{{"dst": "0.0.0.0/0"}}, "dataDir": ipamDir,
				}},
				{
					"type": "aether-cni", "agent_socket": agent.Sock, "netns_pin_dir": pinDir, "netns_unpin_delay_seconds": 0,
					// The PID lookup asks this containerd, which does not list
					// the sandbox during ADD: that must not fail the ADD.
					"cri_socket": "unix://" + criSock, "readiness_probe_budget_ms": 300,
					"log_file": logFile, "log_level": "debug",
					"capabilities": map[string]bool{"io.kubernetes.cri.pod-annotations": true},
				},
			},
		})
		return string(b)
	}
	rt := startContainerd(t, node, cniBin, conf)
	if out, err := exec.Command("ctr", "--address", rt.sock, "-n", "k8s.io", "images", "import", filepath.Join(imgDir, "pause.tar")).CombinedOutput(); err != nil {
		t.Fatalf("ctr import: %v\n%s", err, out)
	}

	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		managed bool
	}{{"web", true}, {"plain", false}} {
		t.Run(tc.name, func(t *testing.T) {
			uid := "uid-" + randHex(6)
			agent.WritePod(t, "shop", tc.name, uid, tc.managed, nil)
			cfg := &runtimeapi.PodSandboxConfig{
				Metadata:    &runtimeapi.PodSandboxMetadata{Name: tc.name, Namespace: "shop", Uid: uid},
				Hostname:    tc.name,
				Annotations: map[string]string{"capture.aether.io/exclude-outbound-ports": "5432"},
				Linux: &runtimeapi.LinuxPodSandboxConfig{
					CgroupParent:    rt.cgroupParent,
					SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD}},
				},
			}
			run, err := rt.cri.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg})
			if err != nil {
				t.Fatalf("RunPodSandbox: %v\n%s", err, rt.log())
			}
			id := run.GetPodSandboxId()
			netnsPath := rt.sandboxNetns(t, id)
			present, err := (capture.Installer{}).Present(netnsPath)
			if err != nil {
				t.Fatal(err)
			}
			rec, recErr := agent.Client(t).GetPod(ctx, id)
			_, pinErr := os.Stat(filepath.Join(pinDir, id))
			if tc.managed {
				if !present {
					t.Fatal("managed pod has no capture table")
				}
				if recErr != nil || !rec.GetManaged() || rec.GetPod().GetUid() != uid || rec.GetPod().GetNetworkNamespace() != filepath.Join(pinDir, id) {
					t.Fatalf("agent record = %v, %v", rec, recErr)
				}
				if rec.GetLastTimings().GetTotal() == nil || rec.GetLastTimings().GetCaptureDivertError() != "" {
					t.Fatalf("timings = %v", rec.GetLastTimings())
				}
				if rec.GetPod().GetPid() != nil {
					t.Logf("sandbox pid reported during ADD: %v", rec.GetPod().GetPid())
				}
				if pinErr != nil {
					t.Fatalf("managed pod not pinned: %v", pinErr)
				}
				// The annotation reached the plugin through runtimeConfig.
				pc := capture.Config{Ports: []uint16{capture.DefaultOutboundPort}, ExcludePorts: []uint16{5432}}
				if err := (capture.Installer{}).Verify(netnsPath, capture.Build(pc)); err != nil {
					t.Fatalf("divert is not the annotated one: %v", err)
				}
			} else {
				if present || !errors.Is(recErr, agentclient.ErrNotFound) || pinErr == nil {
					t.Fatalf("unmanaged pod: table=%v record err=%v pin err=%v", present, recErr, pinErr)
				}
			}
			dels := cniCalls(t, logFile, "pod deleted")
			if _, err := rt.cri.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
				t.Fatalf("StopPodSandbox: %v\n%s", err, rt.log())
			}
			if _, err := rt.cri.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
				t.Fatalf("RemovePodSandbox: %v\n%s", err, rt.log())
			}
			t.Logf("CRI PID lookups that found no sandbox during ADD: %d", cniCalls(t, logFile, "no sandbox pid from CRI (normal during ADD under containerd)"))
			if got := cniCalls(t, logFile, "pod deleted") - dels; got != 2 {
				t.Fatalf("aether-cni DEL succeeded %d times, want 2 (StopPodSandbox, then RemovePodSandbox with empty CNI_NETNS)", got)
			}
			if _, err := agent.Client(t).GetPod(ctx, id); !errors.Is(err, agentclient.ErrNotFound) {
				t.Fatalf("agent record left: %v", err)
			}
			if _, err := os.Stat(filepath.Join(pinDir, id)); !os.IsNotExist(err) {
				t.Fatalf("pin left: %v", err)
			}
		})
	}
}
