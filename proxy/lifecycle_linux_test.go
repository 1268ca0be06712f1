package proxy_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"aether.io/node/proxy"
	"aether.io/node/proxy/proxytest"
)

// TestRunCleanStop: once the proxy serves a pod over one ADS stream or two,
// ending ctx closes the pod and returns nil with every goroutine joined.
func TestRunCleanStop(t *testing.T) {
	for _, split := range []bool{false, true} {
		name := map[bool]string{false: "one stream", true: "split streams"}[split]
		t.Run(name, func(t *testing.T) {
			topo := proxytest.New(t, []string{"client"})
			client := topo.Pods[0]
			ag := startAgent(t)
			ag.addPod(t, client)
			cfg := proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1", AdminAddress: "127.0.0.1:0"}
			if split {
				agL := startAgent(t)
				agL.addPod(t, client)
				cfg.LDSTarget = "unix://" + agL.socket
			}
			leak := goleak.IgnoreCurrent()
			p, err := proxy.New(cfg, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer wcancel()
			if _, err := p.AdminAddr(wctx); err != nil {
				t.Fatal(err)
			}
			if err := proxytest.WaitFor(wctx, func() bool { return client.ReadyCode(wctx) == 200 && p.Peers.Len() == 1 }); err != nil {
				t.Fatalf("pod never served: %+v, %d workloads", p.Manager.Status(), p.Peers.Len())
			}

			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run after a clean stop = %v", err)
			}
			goleak.VerifyNone(t, leak)
			if code := client.ReadyCode(wctx); code != 0 {
				t.Fatalf("pod still answers readiness (%d) after Run returned", code)
			}
		})
	}
}

// TestRunAdminAddressInUse: a failed start returns the error naming the
// address, opens no xDS stream and leaves no goroutine behind.
func TestRunAdminAddressInUse(t *testing.T) {
	ag := startAgent(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = taken.Close() })
	leak := goleak.IgnoreCurrent()
	p, err := proxy.New(proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1", AdminAddress: taken.Addr().String()},
		slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	err = p.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "failed to start admin") || !strings.Contains(err.Error(), taken.Addr().String()) {
		t.Fatalf("Run = %v, want a failed start naming %s", err, taken.Addr())
	}
	goleak.VerifyNone(t, leak)
	select {
	case r := <-ag.requests:
		t.Fatalf("the proxy opened an xDS stream (%s) although it failed to start", r.GetTypeUrl())
	default:
	}
}

// TestRunIdentityBeforeTheAgentSocket: with --workload-api-socket (or
// --spire-admin-socket) naming a socket nobody serves yet, the proxy still
// starts (its xDS stream, started after the identity watch, opens) and
// stops cleanly; the watch retries.
func TestRunIdentityBeforeTheAgentSocket(t *testing.T) {
	for _, tc := range []struct {
		name string
		set  func(cfg *proxy.Config, path string)
	}{
		{"workload api", func(cfg *proxy.Config, path string) { cfg.WorkloadAPISocket = path }},
		{"spire", func(cfg *proxy.Config, path string) { cfg.SPIREAdminSocket = path }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ag := startAgent(t)
			leak := goleak.IgnoreCurrent()
			cfg := proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1"}
			tc.set(&cfg, filepath.Join(t.TempDir(), "not-yet", "workload.sock"))
			p, err := proxy.New(cfg, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			if p.Identity == nil {
				t.Fatal("identity off although its socket is set")
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			select {
			case <-ag.requests:
			case err := <-done:
				t.Fatalf("Run returned before opening its xDS stream: %v", err)
			case <-time.After(20 * time.Second):
				t.Fatal("no xDS stream: the identity watch blocked the start")
			}
			if p.Identity.Bundle() != nil || len(p.Identity.IDs()) != 0 {
				t.Fatal("identity state without a Workload API server")
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run after a clean stop = %v", err)
			}
			goleak.VerifyNone(t, leak)
		})
	}
}

// TestNewIdentityProvidersExclusive: both identity sockets at once is a
// configuration error naming both.
func TestNewIdentityProvidersExclusive(t *testing.T) {
	_, err := proxy.New(proxy.Config{
		XDSTarget: "unix:///nonexistent/xds.sock", NodeID: "node-1",
		WorkloadAPISocket: "/run/aether/agent/workload.sock", SPIREAdminSocket: "/run/spire/admin.sock",
	}, slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "workload.sock") || !strings.Contains(err.Error(), "admin.sock") {
		t.Fatalf("New with both identity sockets = %v, want an error naming both", err)
	}
}

// TestRunMetricsAddress serves /metrics alone on -metrics-address (what a
// Prometheus outside the node scrapes): the Istio series are there,
// /healthz and /debug/pods are not.
func TestRunMetricsAddress(t *testing.T) {
	ag := startAgent(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	runProxyLog(t, proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1", AdminAddress: "127.0.0.1:0", MetricsAddress: addr}, slog.New(slog.DiscardHandler))
	deadline := time.Now().Add(20 * time.Second)
	get := func(path string) (int, string) {
		t.Helper()
		for {
			resp, err := http.Get("http://" + addr + path)
			if err != nil {
				if time.Now().Before(deadline) && strings.Contains(err.Error(), "refused") {
					time.Sleep(10 * time.Millisecond) // not listening yet
					continue
				}
				t.Fatalf("GET %s: %v", path, err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "aether_proxy_pods_serving") {
		t.Errorf("GET /metrics on -metrics-address = %d, want 200 with the proxy's series; body starts %.200q", code, body)
	}
	for _, path := range []string{"/healthz", "/debug/pods"} {
		if code, _ := get(path); code != http.StatusNotFound {
			t.Errorf("GET %s on -metrics-address = %d, want 404: it stays on -admin-address", path, code)
		}
	}
}
