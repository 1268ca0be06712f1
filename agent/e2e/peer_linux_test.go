package e2e

import (
	"context"
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
	"google.golang.org/grpc/status"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/test/harness"
)

const clientModeEnv = "AETHER_AGENT_E2E_CLIENT_SOCKET"

// runClientMode is the test binary re-executed as another uid: one GetPod
// call, printing the gRPC status code.
func runClientMode() int {
	cc, err := grpc.NewClient("unix://"+os.Getenv(clientModeEnv), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Println("DIAL", err)
		return 1
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = cniv1grpc.NewCNIServiceClient(cc).GetPod(ctx, &cniv1.GetPodRequest{ContainerId: "x"})
	fmt.Printf("CODE %s\n", status.Code(err))
	fmt.Printf("MSG %s\n", status.Convert(err).Message())
	return 0
}

// asUser runs the test binary as uid/gid 65534 in client mode against sock.
func asUser(t *testing.T, sock string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	d, err := os.MkdirTemp("", "aether-peer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(d, "client")
	src, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	src.Close()
	dst.Close()
	cmd := exec.Command(bin)
	cmd.Env = []string{clientModeEnv + "=" + sock, "HOME=/"}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("client as uid 65534: %v\n%s", err, out)
	}
	return string(out)
}

func TestNonRootPeerRejected(t *testing.T) {
	harness.RequireRoot(t)
	dir := newAgentDirs(t)
	mdir := filepath.Join(dir, "manifests")
	if err := os.Mkdir(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, dir, "--pod-manifests", mdir)

	// The socket is 0600 in a 0700 directory.
	for path, want := range map[string]os.FileMode{a.sock: 0o600, filepath.Dir(a.sock): 0o700} {
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm() != want {
			t.Fatalf("%s mode = %v, %v; want %04o", path, fi.Mode().Perm(), err, want)
		}
	}
	// With those modes another uid cannot even connect.
	dirOut := asUser(t, a.sock)
	if !strings.Contains(dirOut, "CODE Unavailable") || !strings.Contains(dirOut, "permission denied") {
		t.Fatalf("non-root client through 0700 dir: %s", dirOut)
	}
	// Open the file modes up to reach the second line of defence:
	// SO_PEERCRED must still refuse uid 65534.
	for _, d := range []string{filepath.Dir(a.dir), a.dir, filepath.Dir(a.sock)} {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(a.sock, 0o666); err != nil {
		t.Fatal(err)
	}
	out := asUser(t, a.sock)
	if !strings.Contains(out, "CODE PermissionDenied") {
		t.Fatalf("non-root client with open socket: %s", out)
	}
	if l := a.logs.find("cni peer rejected"); l == nil || l["peer_uid"] != float64(65534) {
		t.Fatalf("no rejection log with peer_uid 65534: %v", l)
	}
	if v := a.metric(t, `aether_agent_peer_rejected_total{socket="cni"}`); v != 1 {
		t.Fatalf("peer rejected count = %v, want 1", v)
	}
	// Each socket counts its own refusals.
	for _, sock := range []string{"admin", "workload_api"} {
		if v := a.metric(t, `aether_agent_peer_rejected_total{socket="`+sock+`"}`); v != 0 {
			t.Fatalf("peer rejected count on %s = %v, want 0 (the refusal was on the cni socket)", sock, v)
		}
	}
	// Root still gets through (NotFound for an unknown container).
	c := a.client(t)
	if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "x"}); status.Code(err).String() != "NotFound" {
		t.Fatalf("root GetPod: %v", err)
	}
}
