package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"aether.io/node/agent/internal/benchstat"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
)

// peerAgent is the AddPod peer: a CNIService on a unix socket whose AddPod
// persists the pod as one JSON file with write+fsync+rename+dir fsync
// before answering (the per-pod file design of Aether's agent), with the
// pod's labels looked up in memory.
type peerAgent struct {
	cniv1grpc.UnimplementedCNIServiceServer
	dir string
}

func (p *peerAgent) AddPod(_ context.Context, req *cniv1.AddPodRequest) (*cniv1.AddPodResponse, error) {
	pod := req.GetPod()
	pod.Labels = map[string]string{"aether.io/managed": "true", "app": pod.GetName()}
	b, err := json.Marshal(pod)
	if err != nil {
		return nil, err
	}
	tmp, err := os.CreateTemp(p.dir, ".tmp-")
	if err != nil {
		return nil, err
	}
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	tmp.Close()
	if err != nil {
		return nil, err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(p.dir, pod.GetContainerId()+".json")); err != nil {
		return nil, err
	}
	d, err := os.Open(p.dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return nil, err
	}
	return &cniv1.AddPodResponse{Result: cniv1.AddPodResponse_RESULT_SUCCESS}, nil
}

func benchAddPod(b *testing.B, c cniv1grpc.CNIServiceClient) {
	ctx := context.Background()
	// Warm the connection.
	if _, err := c.AddPod(ctx, &cniv1.AddPodRequest{Pod: cniPod("bench", "web", "warm", "10.7.0.1")}); err != nil {
		b.Fatal(err)
	}
	var lat benchstat.Latencies
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		r, err := c.AddPod(ctx, &cniv1.AddPodRequest{Pod: cniPod("bench", "web", fmt.Sprintf("c-%08d", i), "10.7.0.1")})
		if err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			b.Fatalf("AddPod = %v, %v", r, err)
		}
		lat.Add(time.Since(t0))
	}
	b.StopTimer()
	lat.Report(b)
}

// BenchmarkAgentAddPod is AddPod warm (connection established) over the
// real unix socket: the aether-agent process (pod from the manifest source,
// record log with group commit, registration) vs a peer CNIService in its own process
// that persists a JSON file per pod with write+fsync+rename+dir fsync, on
// the same disk.
func BenchmarkAgentAddPod(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	b.Run("ours", func(b *testing.B) {
		dir := benchstat.DiskDir(b)
		if err := os.MkdirAll(filepath.Join(dir, "run"), 0o700); err != nil {
			b.Fatal(err)
		}
		mdir := filepath.Join(dir, "manifests")
		if err := os.Mkdir(mdir, 0o755); err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(mdir, "web.yaml"), []byte(podYAML("bench", "web", "uid-web", true, "", "")), 0o644); err != nil {
			b.Fatal(err)
		}
		a := startAgent(b, dir, append([]string{"--pod-manifests", mdir, "--log-level", "warn"}, benchExtra...)...)
		cc, err := grpc.NewClient("unix://"+a.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer cc.Close()
		benchAddPod(b, cniv1grpc.NewCNIServiceClient(cc))
	})
	b.Run("peer", func(b *testing.B) {
		// The peer answers from its own process, as the agent does: both
		// sides pay the same cross-process wakeups on the unix socket.
		dir := benchstat.DiskDir(b)
		sock := startPeer(b, dir)
		cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer cc.Close()
		benchAddPod(b, cniv1grpc.NewCNIServiceClient(cc))
	})
}

// peerModeEnv names the directory the test binary, re-executed by
// startPeer, serves the peer CNIService in (its socket is peer.sock there).
const peerModeEnv = "AETHER_AGENT_E2E_PEER_DIR"

// runPeerMode is the test binary re-executed as the AddPod peer's process:
// it serves peerAgent on <dir>/peer.sock until it is killed.
func runPeerMode() int {
	dir := os.Getenv(peerModeEnv)
	l, err := net.Listen("unix", filepath.Join(dir, "peer.sock"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	gs := grpc.NewServer()
	cniv1grpc.RegisterCNIServiceServer(gs, &peerAgent{dir: dir})
	if err := gs.Serve(l); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// startPeer runs the peer in its own process on dir and returns its socket
// once it serves; the process is killed in tb's cleanup.
func startPeer(tb testing.TB, dir string) string {
	tb.Helper()
	self, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), peerModeEnv+"="+dir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	tb.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	sock := filepath.Join(dir, "peer.sock")
	deadline := time.Now().Add(30 * time.Second)
	for !dialable(sock) {
		select {
		case <-exited:
			tb.Fatalf("peer exited early: %v", cmd.ProcessState)
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatal("peer did not serve within 30s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return sock
}

var benchExtra = strings.Fields(os.Getenv("AETHER_AGENT_BENCH_FLAGS"))
