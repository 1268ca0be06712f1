package crinetns_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/agent/crinetns"
	"aether.io/node/test/containerd"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// sameNetns says whether two paths name the same network namespace.
func sameNetns(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb syscall.Stat_t
	if err := syscall.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// TestFindThroughContainerd runs pod sandboxes in a real containerd (CRI
// plugin, bridge + host-local, no aether-cni: the pods never pass through
// it) and finds each by its uid label: the network namespace containerd
// gave it, which is its pause process's; a host-network pod has none; a
// stopped sandbox and an unknown uid are ErrNoSandbox.
func TestFindThroughContainerd(t *testing.T) {
	harness.RequireRoot(t)
	containerd.Need(t, "containerd", "runc", "ctr")
	node := harness.NewNS(t, "crinode")
	cniBin := t.TempDir()
	ref := harness.ReferencePlugins(t)
	for _, p := range []string{"bridge", "host-local"} {
		if err := os.Symlink(filepath.Join(ref, p), filepath.Join(cniBin, p)); err != nil {
			t.Fatal(err)
		}
	}
	containerd.GoBuild(t, cniBin+"/", "github.com/containernetworking/plugins/plugins/main/loopback")
	bridge := "aetcr" + containerd.RandHex(4)
	ipamDir := filepath.Join(t.TempDir(), "ipam")
	rt := containerd.Start(t, node, cniBin, func(string) string {
		b, _ := json.Marshal(map[string]any{
			"cniVersion": "1.0.0", "name": "plain",
			"plugins": []map[string]any{{"type": "bridge", "bridge": bridge, "isGateway": true, "ipam": map[string]any{
				"type": "host-local", "ranges": [][]map[string]string{{{"subnet": "10.199.7.0/24"}}}, "dataDir": ipamDir,
			}}},
		})
		return string(b)
	})
	rt.ImportPause(t)
	ctx := context.Background()
	finder := crinetns.New(rt.CRI)
	run := func(name string, mode runtimeapi.NamespaceMode) (uid, id string) {
		t.Helper()
		uid = "uid-" + containerd.RandHex(6)
		hostname := name
		if mode == runtimeapi.NamespaceMode_NODE {
			hostname = "" // the node's UTS namespace too, as kubelet runs a host-network pod
		}
		r, err := rt.CRI.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
			Metadata: &runtimeapi.PodSandboxMetadata{Name: name, Namespace: "shop", Uid: uid},
			Hostname: hostname,
			// kubelet labels every sandbox with its pod's identity.
			Labels: map[string]string{crinetns.PodUIDLabel: uid, "io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": "shop"},
			Linux: &runtimeapi.LinuxPodSandboxConfig{
				CgroupParent:    rt.CgroupParent,
				SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: &runtimeapi.NamespaceOption{Network: mode}},
			},
		}})
		if err != nil {
			t.Fatalf("RunPodSandbox %s: %v\n%s", name, err, rt.Log())
		}
		return uid, r.GetPodSandboxId()
	}

	uid, id := run("web", runtimeapi.NamespaceMode_POD)
	sb, err := finder.Find(ctx, uid)
	if err != nil {
		t.Fatalf("Find(web): %v", err)
	}
	if sb.ID != id || sb.NetnsPath != rt.SandboxNetns(t, id) {
		t.Fatalf("Find(web) = %+v, want sandbox %s in %s", sb, id, rt.SandboxNetns(t, id))
	}
	if sb.PID <= 0 || !sameNetns(t, sb.NetnsPath, fmt.Sprintf("/proc/%d/ns/net", sb.PID)) {
		t.Fatalf("Find(web) = %+v: its netns is not its pause process's", sb)
	}
	if sameNetns(t, sb.NetnsPath, node.Path()) {
		t.Fatalf("Find(web) = %+v: the node's own netns", sb)
	}

	hostUID, _ := run("host", runtimeapi.NamespaceMode_NODE)
	if _, err := finder.Find(ctx, hostUID); !errors.Is(err, crinetns.ErrHostNetwork) {
		t.Fatalf("Find(host-network pod) = %v, want ErrHostNetwork", err)
	}
	if _, err := finder.Find(ctx, "uid-unknown"); !errors.Is(err, crinetns.ErrNoSandbox) {
		t.Fatalf("Find(unknown uid) = %v, want ErrNoSandbox", err)
	}
	if _, err := rt.CRI.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
		t.Fatalf("StopPodSandbox: %v\n%s", err, rt.Log())
	}
	if _, err := finder.Find(ctx, uid); !errors.Is(err, crinetns.ErrNoSandbox) {
		t.Fatalf("Find(stopped pod) = %v, want ErrNoSandbox", err)
	}
}
