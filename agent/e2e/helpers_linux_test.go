package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/test/harness"
)

// agent is one aether-agent process.
type agent struct {
	t        testing.TB
	cmd      *exec.Cmd
	dir      string
	sock     string
	admin    string
	state    string
	args     []string
	logs     *syncBuf
	httpAddr string
	exited   chan struct{}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// logLines returns the parsed JSON log lines.
func (s *syncBuf) logLines() []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(s.String()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

func (s *syncBuf) find(msg string) map[string]any {
	for _, l := range s.logLines() {
		if l["msg"] == msg {
			return l
		}
	}
	return nil
}

// newAgentDirs makes the socket and state directories for one agent (the
// state survives restarts of that agent).
func newAgentDirs(t testing.TB) (dir string) {
	t.Helper()
	dir = t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "run"), 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startAgent starts aether-agent with its sockets and state under dir plus
// extra args, and waits until the CNI socket serves.
func startAgent(t testing.TB, dir string, extra ...string) *agent {
	t.Helper()
	bin := filepath.Join(harness.BuildOwn(t, "aether-agent"), "aether-agent")
	a := &agent{
		t: t, dir: dir, sock: filepath.Join(dir, "run", "cni.sock"), admin: filepath.Join(dir, "run", "admin.sock"),
		state: filepath.Join(dir, "state"), logs: &syncBuf{}, exited: make(chan struct{}),
	}
	a.args = []string{
		"--cni-socket", a.sock, "--admin-socket", a.admin, "--state-dir", a.state,
		"--http-addr", "127.0.0.1:0", "--node-name", "node-a", "--uds-csi-root", "/run/aether/uds",
		"--xds-socket", filepath.Join(dir, "run", "xds.sock"), "--lds-socket", filepath.Join(dir, "run", "lds.sock"),
	}
	if !slices.Contains(extra, "--log-level") {
		a.args = append(a.args, "--log-level", "debug")
	}
	a.args = append(a.args, extra...)
	a.cmd = exec.Command(bin, a.args...)
	a.cmd.Stderr = a.logs
	a.cmd.Stdout = a.logs
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = a.cmd.Wait(); close(a.exited) }()
	t.Cleanup(func() {
		a.kill9()
		if t.Failed() {
			t.Logf("agent logs:\n%s", a.logs.String())
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-a.exited:
			t.Fatalf("agent exited early: %v\n%s", a.cmd.ProcessState, a.logs.String())
		default:
		}
		if dialable(a.sock) && dialable(a.admin) {
			if h := a.logs.find("http listening"); h != nil {
				a.httpAddr, _ = h["addr"].(string)
			}
			return a
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not listen within 60s:\n%s", a.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (a *agent) kill9() {
	select {
	case <-a.exited:
		return
	default:
	}
	_ = a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.exited
}

func (a *agent) terminate(t testing.TB) {
	t.Helper()
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("agent did not stop on SIGTERM:\n%s", a.logs.String())
	}
	if code := a.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("agent exit code %d after SIGTERM:\n%s", code, a.logs.String())
	}
}

func (a *agent) client(t testing.TB) cniv1grpc.CNIServiceClient {
	t.Helper()
	cc, err := grpc.NewClient("unix://"+a.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cniv1grpc.NewCNIServiceClient(cc)
}

func (a *agent) waitReady(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + a.httpAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("agent not ready within 60s:\n%s", a.logs.String())
}

func (a *agent) httpGet(t testing.TB, path string) string {
	t.Helper()
	resp, err := http.Get("http://" + a.httpAddr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// metric returns the value of one sample line of /metrics (name with labels
// exactly as exposed), or -1 when absent.
func (a *agent) metric(t testing.TB, sample string) float64 {
	t.Helper()
	for _, l := range strings.Split(a.httpGet(t, "/metrics"), "\n") {
		if rest, ok := strings.CutPrefix(l, sample+" "); ok {
			var v float64
			fmt.Sscan(rest, &v)
			return v
		}
	}
	return -1
}

// eventually polls cond until it holds or 30s pass.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// writeManifest writes a Pod manifest file.
func writeManifest(t testing.TB, dir, file, body string) {
	t.Helper()
	tmp := filepath.Join(dir, "."+file+".tmp")
	if err := os.WriteFile(tmp, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, file)); err != nil {
		t.Fatal(err)
	}
}

func podYAML(ns, name, uid string, managed bool, metaExtra, specExtra string) string {
	m := "false"
	if managed {
		m = "true"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  uid: %s
  labels:
    app: %s
    aether.io/managed: "%s"
  annotations:
    team: mesh
%s
spec:
  nodeName: node-a
  serviceAccountName: sa-%s
  containers:
  - name: c
    image: pause
%s
`, name, ns, uid, name, m, metaExtra, name, specExtra)
}

func dialable(path string) bool {
	c, err := net.Dial("unix", path)
	if err != nil {
		return false
	}
	c.Close()
	return true
}
