package containerd

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/test/harness"
	"aether.io/node/tools/image/oci"
)

// PauseImage is the CRI sandbox_image; ImportPause builds it locally.
const PauseImage = "registry.k8s.io/pause:3.9"

// RandHex returns n random bytes as hex (names that never collide).
func RandHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// GoBuild builds pkg of this module statically into out (a file, or a
// directory when it ends in "/").
func GoBuild(tb testing.TB, out string, pkg string) {
	tb.Helper()
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, pkg)
	cmd.Dir = harness.ModuleRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
}

// Need fails the test (never skips) when a binary the lane runs is missing.
func Need(tb testing.TB, bins ...string) {
	tb.Helper()
	for _, b := range bins {
		if _, err := exec.LookPath(b); err != nil {
			tb.Fatalf("the containerd lane needs %s (Debian: apt-get install containerd runc; or make deps): %v", b, err)
		}
	}
}

// Runtime is one containerd instance with its own root, state, sockets,
// runc root, CNI dirs and cgroup parent, running inside a node netns.
type Runtime struct {
	// Base is the instance's directory (root, state, runc, cni/conf, log).
	Base string
	// Sock is the containerd (and CRI) socket.
	Sock string
	// CgroupParent is the cgroup parent for sandboxes the test creates
	// itself; cleanup removes it in every hierarchy.
	CgroupParent string
	// CRI is the CRI runtime service of this containerd.
	CRI runtimeapi.RuntimeServiceClient
	// Conn is the gRPC connection behind CRI.
	Conn *grpc.ClientConn

	cmd     *exec.Cmd
	done    chan error
	confDir string
}

// ConfDir is the CNI conf dir containerd reads (as containerd sees it).
func (r *Runtime) ConfDir() string {
	if r.confDir != "" {
		return r.confDir
	}
	return filepath.Join(r.Base, "cni", "conf")
}

// RuncRoot is runc's root for containerd's k8s.io namespace.
func (r *Runtime) RuncRoot() string { return filepath.Join(r.Base, "runc", "k8s.io") }

// Start starts containerd in node with the CNI bin dir cniBin and the
// conflist conf(CRI socket) as cni/conf/10-mesh.conflist, and waits until
// CRI reports RuntimeReady and NetworkReady. Everything it leaves is
// removed in tb.Cleanup, also after a crash.
func Start(tb testing.TB, node *harness.NS, cniBin string, conf func(criSock string) string) *Runtime {
	tb.Helper()
	return StartWith(tb, node, cniBin, conf, Options{})
}

// Options tune StartWith for a node that has its own mount namespace (a
// second node of a lane on the same machine).
type Options struct {
	// Wrap prefixes containerd's command line (such as nsenter into the
	// node's mount namespace).
	Wrap []string
	// ConfDir is the CNI conf dir as containerd sees it; empty means
	// cni/conf in its directory.
	ConfDir string
	// View is the prefix under which the test sees containerd's view of
	// the file system (such as /proc/<pid>/root); it is joined before
	// ConfDir when the test writes the conflist.
	View string
}

// StartWith is Start with options.
func StartWith(tb testing.TB, node *harness.NS, cniBin string, conf func(criSock string) string, o Options) *Runtime {
	tb.Helper()
	base, err := os.MkdirTemp("", "aet-ctd-")
	if err != nil {
		tb.Fatal(err)
	}
	r := &Runtime{Base: base, Sock: filepath.Join(base, "containerd.sock"), CgroupParent: "/aet-ctd-" + RandHex(4), confDir: o.ConfDir}
	// Registered first, so it runs last: after containerd stopped.
	tb.Cleanup(func() { r.cleanupHost(tb) })
	for _, d := range []string{"cni/conf", "root", "state", "runc"} {
		if err := os.MkdirAll(filepath.Join(base, d), 0o700); err != nil {
			tb.Fatal(err)
		}
	}
	if err := os.MkdirAll(o.View+r.ConfDir(), 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(o.View+r.ConfDir(), "10-mesh.conflist"), []byte(conf(r.Sock)), 0o600); err != nil {
		tb.Fatal(err)
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
`, filepath.Join(base, "root"), filepath.Join(base, "state"), r.Sock, r.Sock+".ttrpc", PauseImage,
		filepath.Join(base, "runc"), cniBin, r.ConfDir())
	cfgPath := filepath.Join(base, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		tb.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(base, "containerd.log"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { logf.Close() })
	args := append(append([]string{}, o.Wrap...), "containerd", "--config", cfgPath)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// containerd (and the CNI plugins it runs, and its shims) live in the
	// node netns: the bridge never touches the machine's own network.
	if err := node.Do(cmd.Start); err != nil {
		tb.Fatalf("failed to start containerd: %v", err)
	}
	r.cmd, r.done = cmd, make(chan error, 1)
	go func() { r.done <- cmd.Wait() }()
	tb.Cleanup(func() { r.Stop() })

	r.Conn, err = grpc.NewClient("unix://"+r.Sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = r.Conn.Close() })
	r.CRI = runtimeapi.NewRuntimeServiceClient(r.Conn)
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := r.CRI.Status(ctx, &runtimeapi.StatusRequest{})
		cancel()
		if err == nil && allTrue(st.GetStatus().GetConditions()) {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("containerd CRI not ready: %v %v\n%s", err, st.GetStatus(), r.Log())
		}
		select {
		case err := <-r.done:
			tb.Fatalf("containerd exited: %v\n%s", err, r.Log())
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

// Log returns the tail of containerd's log.
func (r *Runtime) Log() string {
	b, _ := os.ReadFile(filepath.Join(r.Base, "containerd.log"))
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return string(b)
}

// Import imports an image tarball into the k8s.io namespace with ctr.
func (r *Runtime) Import(tb testing.TB, tarPath string) {
	tb.Helper()
	if out, err := exec.Command("ctr", "--address", r.Sock, "-n", "k8s.io", "images", "import", tarPath).CombinedOutput(); err != nil {
		tb.Fatalf("ctr images import %s: %v\n%s", tarPath, err, out)
	}
}

// ImportPause builds the pause binary (test/containerd/pause) into the
// sandbox image and imports it: nothing is pulled.
func (r *Runtime) ImportPause(tb testing.TB) {
	tb.Helper()
	r.ImportBinary(tb, "./test/containerd/pause", PauseImage)
}

// ImportBinary builds the command pkg of this module into a one-layer
// image named ref (the binary at /<its name>, the image's entrypoint) and
// imports it.
func (r *Runtime) ImportBinary(tb testing.TB, pkg, ref string) {
	tb.Helper()
	imgDir := tb.TempDir()
	name := path.Base(pkg)
	GoBuild(tb, filepath.Join(imgDir, name), pkg)
	img, err := oci.Build(oci.Spec{
		Files:      []oci.File{{Path: "/" + name, Source: filepath.Join(imgDir, name), Mode: 0o755}},
		Entrypoint: []string{"/" + name},
	})
	if err != nil {
		tb.Fatal(err)
	}
	if err := oci.WriteTarball(filepath.Join(imgDir, name+".tar"), img, ref); err != nil {
		tb.Fatal(err)
	}
	r.Import(tb, filepath.Join(imgDir, name+".tar"))
}

// Stop removes every sandbox left (so shims and pause processes end with
// containerd's knowledge), then stops containerd. It is idempotent.
func (r *Runtime) Stop() {
	if r.cmd == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if l, err := r.CRI.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err == nil {
		for _, s := range l.GetItems() {
			_, _ = r.CRI.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: s.GetId()})
			_, _ = r.CRI.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.GetId()})
		}
	}
	// The exit status after SIGTERM (or the kill) says nothing useful.
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-r.done:
		_ = err
	case <-time.After(30 * time.Second):
		_ = r.cmd.Process.Kill()
		err := <-r.done
		_ = err
	}
	r.cmd = nil
}

// cleanupHost removes what an instance leaves outside its base dir, also
// after a crash: runc containers, mounts under base, its cgroups, the shim
// socket dir when empty, and base itself.
func (r *Runtime) cleanupHost(tb testing.TB) {
	if out, err := exec.Command("runc", "--root", r.RuncRoot(), "list", "-q").Output(); err == nil {
		for _, id := range strings.Fields(string(out)) {
			_ = exec.Command("runc", "--root", r.RuncRoot(), "delete", "--force", id).Run()
		}
	}
	r.stopShims()
	UnmountUnder(r.Base)
	ctrls, _ := os.ReadDir("/sys/fs/cgroup")
	for _, c := range ctrls {
		dir := filepath.Join("/sys/fs/cgroup", c.Name(), r.CgroupParent)
		// Children first (one level: the sandbox cgroups).
		subs, _ := os.ReadDir(dir)
		for _, s := range subs {
			if s.IsDir() {
				_ = syscall.Rmdir(filepath.Join(dir, s.Name()))
			}
		}
		_ = syscall.Rmdir(dir)
	}
	for _, d := range []string{"/run/containerd/s", "/run/containerd/fifo", "/run/containerd"} {
		_ = syscall.Rmdir(d) // only when empty: other instances may share it
	}
	if err := os.RemoveAll(r.Base); err != nil {
		tb.Errorf("failed to remove %s: %v", r.Base, err)
	}
}

// stopShims ends the shims of this instance that outlived containerd (a
// sandbox whose removal failed keeps its shim): SIGTERM by PID to the
// processes whose command line names this instance's socket (a shim then
// removes its socket under /run/containerd/s), SIGKILL after 5 s.
func (r *Runtime) stopShims() {
	var pids []int
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if len(args) == 0 || !strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for i := 0; i+1 < len(args); i++ {
			if args[i] == "-address" && args[i+1] == r.Sock {
				pids = append(pids, pid)
			}
		}
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// UnmountUnder detaches every mount below dir, deepest first.
func UnmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) > 4 && (fs[4] == dir || strings.HasPrefix(fs[4], dir+"/")) {
			mounts = append(mounts, fs[4])
		}
	}
	f.Close()
	for i := len(mounts) - 1; i >= 0; i-- {
		_ = syscall.Unmount(mounts[i], syscall.MNT_DETACH)
	}
}

// SandboxNetns returns the network namespace path containerd gave a sandbox.
func (r *Runtime) SandboxNetns(tb testing.TB, id string) string {
	tb.Helper()
	st, err := r.CRI.PodSandboxStatus(context.Background(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		tb.Fatal(err)
	}
	var info struct {
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string }
			}
		} `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(st.GetInfo()["info"]), &info); err != nil {
		tb.Fatalf("sandbox info: %v", err)
	}
	for _, n := range info.RuntimeSpec.Linux.Namespaces {
		if n.Type == "network" && n.Path != "" {
			return n.Path
		}
	}
	tb.Fatalf("sandbox %s has no network namespace path", id)
	return ""
}
