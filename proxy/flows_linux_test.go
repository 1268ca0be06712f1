package proxy_test

import (
	"context"
	"encoding/json"
	"io"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/api/istio/security"
	"aether.io/node/ctl"
	"aether.io/node/pkg/authz"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy"
	"aether.io/node/proxy/proxytest"
)

// flowsRun is one `aetherctl flows` against the proxy's socket, run on its
// own goroutine until it returns.
type flowsRun struct {
	out  lockedBuffer
	err  error
	done chan struct{}
}

func startFlows(ctx context.Context, sock string, args ...string) *flowsRun {
	r := &flowsRun{done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.err = ctl.RunFlows(ctx, append(args, "--socket", sock), &r.out)
	}()
	return r
}

// events parses the JSON lines of a run with -o json.
func (r *flowsRun) events(t *testing.T) []flowapi.Message {
	t.Helper()
	var out []flowapi.Message
	for l := range strings.SplitSeq(strings.TrimSpace(r.out.String()), "\n") {
		if l == "" {
			continue
		}
		var m flowapi.Message
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

// TestFlowsLive: `aetherctl flows` against a running proxy over its real
// socket, with the client and server pods in their netns, the server's
// inbound captured and a DENY policy on its port 8081: one connection the
// server's app answers, one its proxy refuses. Each run gets exactly the
// events its filters keep, with the fields the access log has: --pod (either
// end), --denied (only the refusal, with its policy), --reporter (one
// side's, as a table), --namespace of no pod (nothing).
func TestFlowsLive(t *testing.T) {
	topo := proxytest.New(t, []string{"client", "server"}, "client", "server")
	client, server := topo.Pods[0], topo.Pods[1]
	if err := (capture.Installer{}).Install(server.NS.Path(), capture.Build(capture.Config{RedirectAll: true, InboundCapture: true})); err != nil {
		t.Fatal(err)
	}
	ag := startAgent(t)
	ag.addPod(t, client)
	ag.addPod(t, server)
	deny := &security.Authorization{
		Name: "deny-8081", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{DestinationPorts: []uint32{8081}}}}}}},
	}
	if err := ag.policies.UpdateResource(authz.Key("default", "deny-8081"), deny); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "proxy-flows", "flows.sock")
	p := runProxy(t, proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1", FlowsSocket: sock})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, pod := range []*proxytest.Pod{client, server} {
		if err := proxytest.WaitFor(ctx, func() bool { return pod.ReadyCode(ctx) == 200 }); err != nil {
			t.Fatalf("pod %s never ready: %+v", pod.Name, p.Manager.Status())
		}
	}
	if err := proxytest.WaitFor(ctx, func() bool { return p.Peers.Len() == 2 && p.Authz.Len() == 1 }); err != nil {
		t.Fatalf("the proxy has %d workloads and %d policies, want 2 and 1", p.Peers.Len(), p.Authz.Len())
	}
	srv := server.Serve(t, 8080)
	server.Serve(t, 8081)

	// Each connection has four events but the refused one: the source
	// side's open and close, the destination side's open and close, or its
	// refusal only. The source side of the refused connection reports
	// either an open and a close or, when the destination's reset reaches
	// its socket before its connect returns (a loaded machine), a refused
	// connect alone: --pod runs until it has the source close.
	byPodCtx, byPodStop := context.WithCancel(ctx)
	byPod := startFlows(byPodCtx, sock, "-o", "json", "--pod", "default/client")
	denied := startFlows(ctx, sock, "-o", "json", "--denied", "--count", "1")
	dest := startFlows(ctx, sock, "--reporter", "destination", "--count", "3")
	noneCtx, noneStop := context.WithCancel(ctx)
	none := startFlows(noneCtx, sock, "-o", "json", "--namespace", "elsewhere")
	if err := proxytest.WaitFor(ctx, func() bool { return p.Metrics.Flows().Subscribers() == 4 }); err != nil {
		t.Fatalf("%d flows subscribers, want 4", p.Metrics.Flows().Subscribers())
	}

	allowed := netip.AddrPortFrom(server.IP4, 8080)
	c, err := client.Dial(ctx, allowed)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = c.Write([]byte("hello"))
	_ = c.CloseWrite()
	if reply, err := io.ReadAll(c); err != nil || !strings.HasPrefix(string(reply), "got 5 from ") {
		t.Fatalf("reply %q, %v", reply, err)
	}
	c.Close()
	<-srv.Got
	refused := netip.AddrPortFrom(server.IP4, 8081)
	if c, err := client.Dial(ctx, refused); err == nil {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = c.Write([]byte("refused"))
		if b, _ := io.ReadAll(c); len(b) > 0 {
			t.Errorf("the denied port answered %q", b)
		}
		c.Close()
	}

	for _, r := range []*flowsRun{denied, dest} {
		<-r.done
		if r.err != nil {
			t.Errorf("aetherctl flows: %v", r.err)
		}
	}
	// The three destination events are out (dest is done); the source
	// close of the refused connection is the last the source side sends.
	refusedSourceClosed := `"type":"closed"`
	if err := proxytest.WaitFor(ctx, func() bool {
		for l := range strings.SplitSeq(byPod.out.String(), "\n") {
			if strings.Contains(l, refusedSourceClosed) && strings.Contains(l, `"reporter":"source"`) && strings.Contains(l, `"dst_addr":"`+refused.String()+`"`) {
				return true
			}
		}
		return false
	}); err != nil {
		t.Fatalf("--pod default/client never got the refused connection's source close:\n%s", byPod.out.String())
	}
	byPodStop()
	noneStop()
	<-byPod.done
	<-none.done

	// --pod: every event of both connections, the client at the source.
	opened, closed, connectFailed := 0, 0, 0
	for _, m := range byPod.events(t) {
		if m.Event == nil || m.SrcPod != "client" || m.SrcNamespace != "default" || m.DstPod != "server" || m.SrcWorkload != "client" {
			t.Errorf("--pod default/client got %+v %+v", m, m.Event)
			continue
		}
		switch m.Type {
		case flowapi.TypeOpened:
			opened++
		case flowapi.TypeClosed:
			closed++
			if m.Reporter == flowapi.ReporterSource && m.DstAddr == allowed.String() && (m.BytesToDst != 5 || m.Reason != "client_closed" || m.Path != "plaintext") {
				t.Errorf("the answered connection's source close: %+v", m.Event)
			}
			if m.Reporter == flowapi.ReporterSource && m.DstAddr == refused.String() && m.Reason == "connect_failed" {
				connectFailed++
			}
		}
	}
	if opened+connectFailed != 3 || closed != 4 {
		t.Errorf("--pod default/client: %d opened (%d refused connects) and %d closed, want 3 (less the refused connects) and 4:\n%s",
			opened, connectFailed, closed, byPod.out.String())
	}
	// --denied: the destination side's refusal, naming its policy.
	if got := denied.events(t); len(got) != 1 || got[0].Type != flowapi.TypeClosed || got[0].Reporter != flowapi.ReporterDestination ||
		got[0].DstAddr != refused.String() || got[0].Reason != "denied" || got[0].PolicyDecision != "deny" ||
		got[0].Policy != authz.Key("default", "deny-8081") || got[0].ResponseFlags != "DENY" || got[0].SrcPod != "client" {
		t.Errorf("--denied got:\n%s", denied.out.String())
	}
	// --reporter destination, as a table: the header and the server
	// side's three rows.
	rows := strings.Split(strings.TrimSpace(dest.out.String()), "\n")
	if len(rows) != 4 || !strings.HasPrefix(rows[0], "TIME (UTC)") {
		t.Fatalf("--reporter destination table:\n%s", dest.out.String())
	}
	var kinds []string
	for _, r := range rows[1:] {
		f := strings.Fields(r)
		if f[1] != "destination" || f[3] != "default/client" || !strings.HasPrefix(f[4], "default/server:808") {
			t.Errorf("row %q", r)
		}
		kinds = append(kinds, f[2]+" "+f[4])
	}
	for _, want := range []string{"open default/server:8080", "close default/server:8080", "close default/server:8081"} {
		if !strings.Contains(strings.Join(kinds, ","), want) {
			t.Errorf("--reporter destination lacks %q:\n%s", want, dest.out.String())
		}
	}
	if none.err != nil || none.out.String() != "" {
		t.Errorf("--namespace elsewhere: %v\n%s", none.err, none.out.String())
	}
	// Gone clients are gone from the hub.
	if err := proxytest.WaitFor(ctx, func() bool { return p.Metrics.Flows().Subscribers() == 0 }); err != nil {
		t.Errorf("%d flows subscribers after every run ended", p.Metrics.Flows().Subscribers())
	}
}

// TestNewFlowsSocketInAgentDir: the flows socket may not be put in a
// directory the agent serves.
func TestNewFlowsSocketInAgentDir(t *testing.T) {
	for _, sock := range []string{"/run/aether/proxy/flows.sock", "/run/aether/agent/flows.sock"} {
		_, err := proxy.New(proxy.Config{XDSTarget: "unix:///run/aether/proxy/xds.sock", FlowsSocket: sock}, nil)
		if err == nil || !strings.Contains(err.Error(), "in the agent's socket dir") {
			t.Errorf("New with -flows-socket %s: %v", sock, err)
		}
	}
}
