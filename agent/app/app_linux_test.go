package app

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/identity/identitytest"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/xds/resource"
)

// testConfig is a config whose every socket, the store and the pod
// manifests live under a fresh directory; HTTP picks a free port.
func testConfig(t *testing.T, extra ...string) *Config {
	t.Helper()
	dir := t.TempDir()
	run := filepath.Join(dir, "run")
	if err := os.MkdirAll(filepath.Join(dir, "manifests"), 0o755); err != nil {
		t.Fatal(err)
	}
	args := append([]string{
		"--node-name", "n1", "--allowed-uids", "0",
		"--cni-socket", filepath.Join(run, "cni.sock"), "--admin-socket", filepath.Join(run, "admin.sock"),
		"--xds-socket", filepath.Join(run, "xds.sock"), "--lds-socket", filepath.Join(run, "lds.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--pod-manifests", filepath.Join(dir, "manifests"),
		"--http-addr", "127.0.0.1:0", "--shutdown-timeout", "5s",
	}, extra...)
	c, err := ParseFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitServing waits until the admin socket answers: it is the last part
// started, so every part is up. done receives Run's result; one that
// arrives early fails the test and is put back for a cleanup to read.
func waitServing(ctx context.Context, t *testing.T, c *Config, done chan error) {
	t.Helper()
	admin := adminapi.NewClient(c.AdminSocket)
	for {
		if _, err := admin.Pods(ctx); err == nil {
			return
		}
		select {
		case err := <-done:
			done <- err
			t.Fatalf("Run returned before serving: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// runAgent runs the agent with c until the test ends (then checks it
// stopped cleanly). done receives Run's result; ctx ends with the test.
func runAgent(t *testing.T, c *Config) (ctx context.Context, done chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- Run(ctx, c, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run after a clean stop = %v", err)
		}
	})
	return ctx, done
}

// assertNoSockets checks Run removed the socket files it created.
func assertNoSockets(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		if fi, err := os.Lstat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
			t.Errorf("socket %q left behind", p)
		}
	}
}

// assertStoreFree checks Run closed the store: it opens again (the
// store's flock on agent.lock would otherwise time out).
func assertStoreFree(t *testing.T, dir string) {
	t.Helper()
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return // the store never opened
	}
	st, err := store.Open(dir, store.Options{NoSync: true})
	if err != nil {
		t.Fatalf("store still held after Run: %v", err)
	}
	_ = st.Close()
}

// TestRunCleanStop serves every socket, answers a CNI and an admin call,
// then stops on ctx and joins every goroutine.
func TestRunCleanStop(t *testing.T) {
	leak := goleak.IgnoreCurrent()
	c := testConfig(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, c, slog.New(slog.DiscardHandler)) }()

	waitServing(ctx, t, c, done)
	cc, err := grpc.NewClient("unix://"+c.CNISocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	_, err = cniv1grpc.NewCNIServiceClient(cc).GetPod(ctx, &cniv1.GetPodRequest{ContainerId: "c1"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("GetPod of an unknown container = %v, want NotFound", err)
	}
	_ = cc.Close()
	for _, p := range []string{c.XDSSocket, c.LDSSocket} {
		conn, err := net.Dial("unix", p)
		if err != nil {
			t.Errorf("xds socket %q not served: %v", p, err)
			continue
		}
		_ = conn.Close()
	}
	// A workload discovery client stays connected through the stop: the
	// agent ends its stream (it does not wait for the client to leave).
	wcc, err := grpc.NewClient("unix://"+c.XDSSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer wcc.Close()
	wctx, wcancel := context.WithCancel(context.Background())
	defer wcancel()
	ws, err := discovery.NewAggregatedDiscoveryServiceClient(wcc).DeltaAggregatedResources(wctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ws.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.WorkloadType, Node: &core.Node{Id: "n1"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := ws.Recv(); err != nil {
		t.Fatalf("first workload response: %v", err)
	}

	cancel()
	if _, err := ws.Recv(); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "shutting down") {
		t.Errorf("workload stream at the agent's stop: %v; want Unavailable, shutting down", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Run after a clean stop = %v", err)
	}
	wcancel()
	_ = wcc.Close()
	goleak.VerifyNone(t, leak)
	assertNoSockets(t, c.CNISocket, c.AdminSocket, c.XDSSocket, c.LDSSocket)
	assertStoreFree(t, c.StateDir)
}

// openDir makes a directory open to group and others (0755) next to c's
// state dir, holding a file that is not the agent's: the agent does not
// tighten it, and the socket policy refuses to serve from it.
func openDir(t *testing.T, c *Config) string {
	t.Helper()
	open := filepath.Join(filepath.Dir(c.StateDir), "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(open, "notes.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return open
}

// TestRunFailedStart checks a part that cannot start stops every part
// started before it and releases their sockets, files and locks.
func TestRunFailedStart(t *testing.T) {
	for _, tc := range []struct {
		name string
		// breakIt prepares c so that one part cannot start.
		breakIt func(t *testing.T, c *Config)
		wantErr []string
	}{
		{
			name: "store cannot open",
			breakIt: func(t *testing.T, c *Config) {
				if err := os.WriteFile(c.StateDir, []byte("not a dir"), 0o600); err != nil {
					t.Fatal(err)
				}
			},
			wantErr: []string{"failed to start store"},
		},
		{
			name: "http port in use",
			breakIt: func(t *testing.T, c *Config) {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ln.Close() })
				c.HTTPAddr = ln.Addr().String()
			},
			wantErr: []string{"failed to start http", "--http-addr"},
		},
		{
			name: "xds socket dir open to others",
			breakIt: func(t *testing.T, c *Config) {
				c.XDSSocket = filepath.Join(openDir(t, c), "xds.sock")
			},
			wantErr: []string{"failed to start wds_socket", "must be 0700", "--xds-socket", `not tightened: it holds "notes.txt"`, "fix: chmod 0700"},
		},
		{
			name: "workload api socket dir open to others",
			breakIt: func(t *testing.T, c *Config) {
				cert, key := identitytest.Files(t, t.TempDir(), identitytest.Valid("cluster.local"))
				c.CACertFile, c.CAKeyFile, c.WorkloadAPISocket = cert, key, filepath.Join(openDir(t, c), "workload.sock")
				if err := c.loadCA(time.Now()); err != nil {
					t.Fatal(err)
				}
			},
			wantErr: []string{"failed to start workload_api_socket", "must be 0700", "--workload-api-socket", `not tightened: it holds "notes.txt"`, "fix: chmod 0700"},
		},
		{
			name: "cni socket served by another process",
			breakIt: func(t *testing.T, c *Config) {
				if err := os.MkdirAll(filepath.Dir(c.CNISocket), 0o700); err != nil {
					t.Fatal(err)
				}
				ln, err := net.Listen("unix", c.CNISocket)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ln.Close() })
			},
			wantErr: []string{"failed to start cni_socket", "cni.sock", "another process is serving it"},
		},
		{
			name: "admin socket path is a directory",
			breakIt: func(t *testing.T, c *Config) {
				if err := os.MkdirAll(c.AdminSocket, 0o700); err != nil {
					t.Fatal(err)
				}
			},
			wantErr: []string{"failed to start admin_socket", "admin.sock", "in the way"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testConfig(t)
			tc.breakIt(t, c)
			leak := goleak.IgnoreCurrent()
			err := Run(context.Background(), c, slog.New(slog.DiscardHandler))
			if err == nil {
				t.Fatal("Run succeeded, want a failed start")
			}
			for _, w := range tc.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Run = %q, want it to contain %q", err, w)
				}
			}
			goleak.VerifyNone(t, leak)
			// Every socket the agent opened is gone; the live CNI socket
			// belongs to someone else and stays.
			assertNoSockets(t, c.AdminSocket, c.XDSSocket, c.LDSSocket)
			assertStoreFree(t, c.StateDir)
		})
	}
}

// TestRunSocketDirUnderOpenParent lays the sockets out as the defaults do
// (<root>/run/aether/agent/{cni,admin}.sock and
// <root>/run/aether/proxy/{xds,lds,workload}.sock) with <root>/run/aether
// already 0755, as kubelet's hostPath DirectoryOrCreate and aether-cni's
// pin directory make it, and the proxy directory already created 0755 by
// kubelet for the proxy's mount: the agent starts, creates its own socket
// directory 0700, tightens the proxy's to 0700 in place (the same
// directory, so a bind mount of it still sees the sockets) and serves.
func TestRunSocketDirUnderOpenParent(t *testing.T) {
	root := t.TempDir()
	under := func(p string) string { return filepath.Join(root, strings.TrimPrefix(p, "/")) }
	parent := under(filepath.Dir(SocketDir))
	if err := os.MkdirAll(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	agentDir, proxyDir := under(SocketDir), under(ProxySocketDir)
	if err := os.Mkdir(proxyDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(proxyDir, 0o755); err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(proxyDir)
	if err != nil {
		t.Fatal(err)
	}
	cert, key := identitytest.Files(t, t.TempDir(), identitytest.Valid("cluster.local"))
	extra := []string{"--ca-cert", cert, "--ca-key", key}
	for name, dir := range map[string]string{"cni": agentDir, "admin": agentDir, "xds": proxyDir, "lds": proxyDir} {
		extra = append(extra, "--"+name+"-socket", filepath.Join(dir, name+".sock"))
	}
	extra = append(extra, "--workload-api-socket", filepath.Join(proxyDir, "workload.sock"))
	c := testConfig(t, extra...)
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)
	for _, dir := range []string{agentDir, proxyDir} {
		fi, err := os.Stat(dir)
		if err != nil {
			t.Fatal(err)
		}
		if perm := fi.Mode().Perm(); perm != 0o700 {
			t.Errorf("socket dir %q mode = %04o, want 0700", dir, perm)
		}
	}
	if after, err := os.Stat(proxyDir); err != nil || !os.SameFile(before, after) {
		t.Errorf("proxy socket dir %q was replaced (err %v); it must be tightened in place", proxyDir, err)
	}
	for _, p := range []string{c.CNISocket, c.XDSSocket, c.LDSSocket, c.WorkloadAPISocket} {
		conn, err := net.Dial("unix", p)
		if err != nil {
			t.Errorf("socket %q not served: %v", p, err)
			continue
		}
		_ = conn.Close()
	}
}

// TestMetricsAddr serves /metrics alone on --metrics-addr (the address a
// Prometheus outside the node scrapes), while /healthz and /readyz stay on
// --http-addr only.
func TestMetricsAddr(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	c := testConfig(t, "--metrics-addr", addr)
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "aether_agent_") {
		t.Errorf("GET /metrics on --metrics-addr = %d, want 200 with aether_agent_* series; body starts %.200q", code, body)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := get(p); code != http.StatusNotFound {
			t.Errorf("GET %s on --metrics-addr = %d, want 404: health stays on --http-addr", p, code)
		}
	}
}
