package proxy_test

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"aether.io/node/proxy"
	"aether.io/node/proxy/proxytest"
)

// TestAgentRestartInvisible: with the agent gone (its xDS server stopped,
// as when it crashes or is upgraded) the proxy keeps every pod's listeners
// and workloads: an established connection keeps flowing and new captured
// connections are proxied; when an agent serves the same socket again
// (fresh caches, the same pods) the proxy resubscribes and keeps every
// listener as it is: no pod is drained and bound again, and the connection
// open across both restarts still echoes.
func TestAgentRestartInvisible(t *testing.T) {
	topo := proxytest.New(t, []string{"client", "server"}, "client")
	client, server := topo.Pods[0], topo.Pods[1]
	ag := startAgent(t)
	ag.addPod(t, client)
	ag.addPod(t, server)
	logs := &lockedBuffer{}
	p := runProxyLog(t, proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1"}, slog.New(slog.NewTextHandler(logs, nil)))
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	served := func() bool { return client.ReadyCode(wctx) == 200 && p.Peers.Len() == 2 }
	if err := proxytest.WaitFor(wctx, served); err != nil {
		t.Fatalf("pods never served: %+v\n%s", p.Manager.Status(), logs)
	}
	const appPort = 8080
	server.Echo(t, appPort)
	dst := netip.AddrPortFrom(server.IP4, appPort)
	long, err := client.Dial(wctx, dst)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()
	rd := bufio.NewReader(long)
	echo := func(what string) {
		t.Helper()
		_ = long.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(long, what+"\n"); err != nil {
			t.Fatalf("%s: the long-lived connection: %v", what, err)
		}
		if got, err := rd.ReadString('\n'); err != nil || got != what+"\n" {
			t.Fatalf("%s: the long-lived connection echoed %q, %v", what, got, err)
		}
	}
	fresh := func(what string) {
		t.Helper()
		c, err := client.Dial(wctx, dst)
		if err != nil {
			t.Fatalf("%s: a new connection: %v", what, err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		b := make([]byte, 3)
		if _, err := c.Write([]byte("new")); err != nil {
			t.Fatalf("%s: a new connection: %v", what, err)
		}
		if _, err := io.ReadFull(c, b); err != nil || string(b) != "new" {
			t.Fatalf("%s: a new connection echoed %q, %v", what, b, err)
		}
	}
	echo("before")
	binds := strings.Count(logs.String(), "pod listeners serving")
	if binds != 2 {
		t.Fatalf("%d pods bound at the start, want 2 (the log is what the restart is checked by):\n%s", binds, logs)
	}

	ag.stop()
	// The stream ends; the proxy retries in the background.
	if err := proxytest.WaitFor(wctx, func() bool { return strings.Contains(logs.String(), "xds stream ended") }); err != nil {
		t.Fatalf("the proxy never saw the agent go:\n%s", logs)
	}
	echo("agent gone")
	fresh("agent gone")
	if !served() {
		t.Fatalf("a pod stopped being served while the agent was gone: %+v", p.Manager.Status())
	}

	ag2 := startAgentAt(t, ag.socket)
	ag2.addPod(t, client)
	ag2.addPod(t, server)
	// Resubscribed: the proxy's first request on the new stream, then an
	// ACK of what the new agent sent.
	acked := 0
	for acked < 2 {
		select {
		case r := <-ag2.requests:
			if r.GetResponseNonce() != "" {
				acked++
			}
		case <-wctx.Done():
			t.Fatalf("the proxy did not resubscribe to the restarted agent:\n%s", logs)
		}
	}
	// Whatever the new agent's pushes cause has happened by now (the
	// reconcile follows each push at once); give it a moment to be sure.
	time.Sleep(200 * time.Millisecond)
	echo("agent back")
	fresh("agent back")
	if n := strings.Count(logs.String(), "draining pod listeners"); n != 0 {
		t.Errorf("%d pods drained across the agent's restart, want none:\n%s", n, logs)
	}
	if n := strings.Count(logs.String(), "pod listeners serving"); n != binds {
		t.Errorf("pods bound %d times across the agent's restart (%d before it), want no new bind:\n%s", n, binds, logs)
	}
}
