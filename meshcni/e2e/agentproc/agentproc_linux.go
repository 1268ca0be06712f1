package agentproc

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/test/harness"
)

// NodeName is the node name the agent runs with and pods are placed on.
const NodeName = "node-e2e"

// Agent is one aether-agent process.
type Agent struct {
	// Sock is the CNIService socket; Dir the agent's temp dir; PodsDir its
	// pod source.
	Sock, Dir, PodsDir string
	// XDSSocket and LDSSocket are workload and listener discovery, in a
	// directory of their own (<Dir>/proxy), as the proxy's sockets are
	// split from the agent's private ones (<Dir>/run) on a node.
	XDSSocket, LDSSocket string

	t      testing.TB
	bin    string
	node   *harness.NS
	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	exit   error
	stderr *bytes.Buffer
}

// Start builds (once) and starts aether-agent inside node, waits until it
// serves, and stops it in t.Cleanup.
func Start(t testing.TB, node *harness.NS) *Agent {
	t.Helper()
	bins := harness.BuildOwn(t, "aether-cni", "aether-agent")
	dir, err := os.MkdirTemp("", "aet-agent-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	a := &Agent{
		t: t, bin: filepath.Join(bins, "aether-agent"), Dir: dir,
		Sock: filepath.Join(dir, "run", "cni.sock"), PodsDir: filepath.Join(dir, "pods"), node: node,
		XDSSocket: filepath.Join(dir, "proxy", "xds.sock"), LDSSocket: filepath.Join(dir, "proxy", "lds.sock"),
	}
	for _, d := range []string{filepath.Join(dir, "run"), a.PodsDir, filepath.Join(dir, "state"), filepath.Join(dir, "uds")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	a.Restart()
	t.Cleanup(a.Stop)
	return a
}

// Restart starts the agent (after Stop) and waits until it serves.
func (a *Agent) Restart() {
	a.t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stderr = &bytes.Buffer{}
	cmd := exec.Command(a.bin,
		"--cni-socket", a.Sock, "--admin-socket", "", "--state-dir", filepath.Join(a.Dir, "state"),
		"--xds-socket", a.XDSSocket, "--lds-socket", a.LDSSocket,
		"--pod-manifests", a.PodsDir, "--pod-manifests-interval", "100ms", "--node-name", NodeName,
		"--uds-csi-root", filepath.Join(a.Dir, "uds"), "--http-addr", "127.0.0.1:0", "--log-level", "debug")
	cmd.Stderr = a.stderr
	cmd.Stdout = a.stderr
	// Started from a thread inside the node netns, so the agent's loopback
	// listeners live there.
	if err := a.node.Do(cmd.Start); err != nil {
		a.t.Fatalf("failed to start aether-agent: %v", err)
	}
	a.cmd = cmd
	done := make(chan struct{})
	a.done = done
	go func() { a.exit = cmd.Wait(); close(done) }()
	c, err := agentclient.New(a.Sock, agentclient.Options{Timeout: time.Second, Attempts: 1, ReportTimeout: time.Second})
	if err != nil {
		a.t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := c.Ready(context.Background())
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			a.t.Fatalf("aether-agent not ready on %s: %v\n%s", a.Sock, err, a.stderr)
		}
		select {
		case <-a.done:
			a.t.Fatalf("aether-agent exited at start: %v\n%s", a.exit, a.stderr)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stop stops the agent with SIGTERM (SIGKILL after 30 s); stopping a
// stopped agent does nothing.
func (a *Agent) Stop() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return
	}
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.done:
	case <-time.After(30 * time.Second):
		_ = a.cmd.Process.Kill()
		<-a.done
	}
	a.cmd = nil
}

// Client returns a client of the agent, closed in t.Cleanup.
func (a *Agent) Client(t testing.TB) *agentclient.Client {
	t.Helper()
	c, err := agentclient.New(a.Sock, agentclient.Options{Timeout: 2 * time.Second, Attempts: 1, ReportTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// WritePod puts a Pod manifest into the agent's pod source; managed sets
// aether.io/managed=true.
func (a *Agent) WritePod(t testing.TB, namespace, name, uid string, managed bool, annotations map[string]string) {
	t.Helper()
	labels := map[string]string{"app": name}
	if managed {
		labels["aether.io/managed"] = "true"
	}
	doc := map[string]any{
		"apiVersion": "v1", "kind": "Pod",
		"metadata": map[string]any{"name": name, "namespace": namespace, "uid": uid, "labels": labels, "annotations": annotations},
		"spec":     map[string]any{"nodeName": NodeName, "containers": []map[string]any{{"name": "app", "image": "app:1"}}},
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(a.PodsDir, namespace+"_"+name+".json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
}
