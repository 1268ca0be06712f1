package containerd_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/meshcni/e2e/agentproc"
	"aether.io/node/pkg/capture"
	"aether.io/node/test/containerd"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

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
	containerd.Need(t, "containerd", "runc", "ctr")
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
	containerd.GoBuild(t, cniBin+"/", "github.com/containernetworking/plugins/plugins/main/loopback")

	pinDir := filepath.Join(t.TempDir(), "pins")
	t.Cleanup(func() {
		names, _ := os.ReadDir(pinDir)
		for _, n := range names {
			_ = syscall.Unmount(filepath.Join(pinDir, n.Name()), syscall.MNT_DETACH)
		}
	})
	logFile := filepath.Join(t.TempDir(), "aether-cni.log")
	ipamDir := filepath.Join(t.TempDir(), "ipam")
	bridge := "aetcb" + containerd.RandHex(4)
	subnet := fmt.Sprintf("10.%d.%d.0/24", 200+int(containerd.RandHex(1)[0])%50, int(containerd.RandHex(1)[1])%250)
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
					// No proxy runs in this lane: the probe fails, and
					// "open" lets managed pods start (uncaptured) anyway.
					"capture_failure": "open", "log_file": logFile, "log_level": "debug",
					"capabilities": map[string]bool{"io.kubernetes.cri.pod-annotations": true},
				},
			},
		})
		return string(b)
	}
	rt := containerd.Start(t, node, cniBin, conf)
	rt.ImportPause(t)

	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		managed bool
	}{{"web", true}, {"plain", false}} {
		t.Run(tc.name, func(t *testing.T) {
			uid := "uid-" + containerd.RandHex(6)
			agent.WritePod(t, "shop", tc.name, uid, tc.managed, nil)
			cfg := &runtimeapi.PodSandboxConfig{
				Metadata:    &runtimeapi.PodSandboxMetadata{Name: tc.name, Namespace: "shop", Uid: uid},
				Hostname:    tc.name,
				Annotations: map[string]string{"capture.aether.io/exclude-outbound-ports": "5432"},
				Linux: &runtimeapi.LinuxPodSandboxConfig{
					CgroupParent:    rt.CgroupParent,
					SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD}},
				},
			}
			run, err := rt.CRI.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg})
			if err != nil {
				t.Fatalf("RunPodSandbox: %v\n%s", err, rt.Log())
			}
			id := run.GetPodSandboxId()
			netnsPath := rt.SandboxNetns(t, id)
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
				if recErr != nil || !rec.Managed || rec.Pod == nil || rec.Pod.UID != uid || rec.Pod.NetworkNamespace != filepath.Join(pinDir, id) {
					t.Fatalf("agent record = %+v, %v", rec, recErr)
				}
				if rec.LastTimings == nil || rec.LastTimings.Total == nil || rec.LastTimings.CaptureDivertError != "" {
					t.Fatalf("timings = %+v", rec.LastTimings)
				}
				if rec.Pod.PID != nil {
					t.Logf("sandbox pid reported during ADD: %d", *rec.Pod.PID)
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
			if _, err := rt.CRI.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
				t.Fatalf("StopPodSandbox: %v\n%s", err, rt.Log())
			}
			if _, err := rt.CRI.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
				t.Fatalf("RemovePodSandbox: %v\n%s", err, rt.Log())
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
