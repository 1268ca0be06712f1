package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"aether.io/node/test/harness"
)

// TestMain removes the binaries BuildOwn made (harness.Main).
func TestMain(m *testing.M) { harness.Main(m) }

// startTimeout bounds a broken run of the binary; it is no speed goal.
const startTimeout = 10 * time.Second

// TestServesUntilSIGTERM runs the release binary as the chart does: its
// socket in a kubelet plugin dir that hostPath DirectoryOrCreate made 0755,
// answers Identity and NodeGetInfo there, creates the root, registers with
// kubelet through <kubelet-dir>/plugins_registry/csi.aether.io-reg.sock
// (made 0755 by kubelet's plugin watcher), and on SIGTERM exits 0 and
// removes both sockets.
func TestServesUntilSIGTERM(t *testing.T) {
	bin := filepath.Join(harness.BuildOwn(t, "aether-csi"), "aether-csi")
	dir, err := os.MkdirTemp("", "csi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	plugin := filepath.Join(dir, "kubelet", "plugins", "csi.aether.io")
	if err := os.MkdirAll(plugin, 0o755); err != nil {
		t.Fatal(err)
	}
	registry := filepath.Join(dir, "kubelet", "plugins_registry")
	if err := os.MkdirAll(registry, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{plugin, registry} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sock, root := filepath.Join(plugin, "csi.sock"), filepath.Join(dir, "uds")
	regSock := filepath.Join(registry, "csi.aether.io-reg.sock")
	cmd := exec.Command(bin, "--endpoint", sock, "--uds-csi-root", root, "--kubelet-dir", filepath.Join(dir, "kubelet"), "--node-name", "node-a")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	conn := dial(t, sock)
	id := csipb.NewIdentityClient(conn)
	// WaitForReady rides out the start-up: the first call waits for the socket.
	info, err := id.GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetPluginInfo: %v", err)
	}
	if info.GetName() != "csi.aether.io" || info.GetVendorVersion() == "" {
		t.Errorf("GetPluginInfo = %v, want csi.aether.io and a version", info)
	}
	if p, err := id.Probe(ctx, &csipb.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Errorf("Probe = %v, %v; want ready", p, err)
	}
	if ni, err := csipb.NewNodeClient(conn).NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{}); err != nil || ni.GetNodeId() != "node-a" {
		t.Errorf("NodeGetInfo = %v, %v; want node-a", ni, err)
	}
	if fi, err := os.Stat(root); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("root %s: %v, %v; want a 0700 dir", root, fi.Mode(), err)
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %s: %v, %v; want mode 0600", sock, fi.Mode(), err)
	}

	// kubelet's plugin watcher: GetInfo, then the verdict.
	reg := registerapi.NewRegistrationClient(dial(t, regSock))
	pi, err := reg.GetInfo(ctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetInfo on %s: %v", regSock, err)
	}
	if pi.GetType() != registerapi.CSIPlugin || pi.GetName() != "csi.aether.io" || pi.GetEndpoint() != sock || !slices.Equal(pi.GetSupportedVersions(), []string{"1.0.0"}) {
		t.Errorf("GetInfo = %v, want a CSIPlugin csi.aether.io at %s speaking 1.0.0", pi, sock)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Errorf("NotifyRegistrationStatus: %v", err)
	}
	if fi, err := os.Lstat(regSock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("registration socket %s: %v, %v; want mode 0600", regSock, fi.Mode(), err)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v, want 0", err)
		}
	case <-ctx.Done():
		t.Fatal("aether-csi did not exit after SIGTERM")
	}
	for _, s := range []string{sock, regSock} {
		if _, err := os.Lstat(s); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket %s left after exit: %v", s, err)
		}
	}
}

// dial returns a gRPC client of the unix socket at path, closed in
// t.Cleanup.
func dial(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func TestBadFlagsExit2(t *testing.T) {
	bin := filepath.Join(harness.BuildOwn(t, "aether-csi"), "aether-csi")
	for _, args := range [][]string{{"--no-such-flag"}, {"--uds-csi-root", "relative"}, {"--log-level", "loud"}, {"--registration-dir", "relative"}} {
		err := exec.Command(bin, args...).Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 {
			t.Errorf("aether-csi %q: %v, want exit status 2", args, err)
		}
	}
}
