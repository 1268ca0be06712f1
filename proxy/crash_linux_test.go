package proxy_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"aether.io/node/proxy/proxytest"
	"aether.io/node/test/harness"
)

// crashPods returns the pod counts TestProxyCrash runs: 10 and 100, and
// the count AETHER_CRASH_PODS gives (2 to 200) as well.
func crashPods(t *testing.T) []int {
	counts := []int{10, 100}
	if v := os.Getenv("AETHER_CRASH_PODS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 2 || n > 200 {
			t.Fatalf("invalid AETHER_CRASH_PODS %q: a pod count from 2 to 200", v)
		}
		counts = append(counts, n)
	}
	return counts
}

// proxyProc is an aether-proxy process of the test.
type proxyProc struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{}
}

// startProxyProc starts aether-proxy on the agent's socket xds with no
// hand-over socket, then the flags of extra (which win).
func startProxyProc(t testing.TB, bin, xds string, extra ...string) *proxyProc {
	t.Helper()
	p := &proxyProc{out: &lockedBuffer{}, done: make(chan struct{})}
	args := append([]string{"-xds-address", "unix://" + xds, "-node-id", "node-1", "-admin-address", "", "-log-level", "warn", "-handover-socket", ""}, extra...)
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.kill() })
	return p
}

// kill sends SIGKILL to the process (by its PID) and waits for it.
func (p *proxyProc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// allServed waits until every pod's readiness endpoint answers 200 (its
// listeners bound and served by the proxy) and returns when that was.
func allServed(t testing.TB, pods []*proxytest.Pod, p *proxyProc) time.Time {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pending := append([]*proxytest.Pod(nil), pods...)
	for len(pending) > 0 {
		var left []*proxytest.Pod
		for _, pod := range pending {
			if pod.ReadyCode(ctx) != 200 {
				left = append(left, pod)
			}
		}
		pending = left
		if len(pending) == 0 {
			break
		}
		select {
		case <-p.done:
			t.Fatalf("aether-proxy exited with %d pods not served:\n%s", len(pending), p.out.String())
		case <-ctx.Done():
			t.Fatalf("%d of %d pods not served after 60 s:\n%s", len(pending), len(pods), p.out.String())
		case <-time.After(2 * time.Millisecond):
		}
	}
	return time.Now()
}

// TestProxyCrash: aether-proxy killed with SIGKILL while it serves every
// pod of the node. Captured traffic fails closed meanwhile (a pod's
// connection to another pod's app ends at its capture divert, whose
// listener is gone, and never reaches the app); a new proxy process (what
// kubelet starts after the crash) serves every pod again, from the agent's
// xDS, with no pod restarted. The time from the new process's start to
// every pod served is logged for 10 and 100 pods (and AETHER_CRASH_PODS):
// proxy/README.md "Crash and restart" has the figures.
func TestProxyCrash(t *testing.T) {
	bin := filepath.Join(harness.BuildOwn(t, "aether-proxy"), "aether-proxy")
	for _, n := range crashPods(t) {
		t.Run(fmt.Sprintf("%d pods", n), func(t *testing.T) {
			names := make([]string, n)
			for i := range names {
				names[i] = fmt.Sprintf("p%d", i)
			}
			topo := proxytest.New(t, names, names...)
			pods := topo.Pods
			ag := startAgent(t)
			for _, p := range pods {
				ag.addPod(t, p)
			}
			const appPort = 8080
			app := pods[1].Serve(t, appPort)

			first := startProxyProc(t, bin, ag.socket)
			started := time.Now()
			served := allServed(t, pods, first)
			t.Logf("%d pods served %s after the first process started", n, served.Sub(started).Round(time.Millisecond))
			// Through the proxy while it runs: the divert hands it the
			// connection and it forwards to the app.
			if _, err := roundTripTo(t, pods[0], netip.AddrPortFrom(pods[1].IP4, appPort), "before"); err != nil {
				t.Fatalf("captured connection before the crash: %v", err)
			}
			<-app.Got

			first.kill()
			killed := time.Now()
			// Fail closed: the divert still sends the pod's connections to
			// a listener that is gone; nothing reaches the app.
			reply, err := roundTripTo(t, pods[0], netip.AddrPortFrom(pods[1].IP4, appPort), "bypass")
			if err == nil {
				t.Fatalf("a captured connection passed with no proxy: %q", reply)
			}
			t.Logf("with no proxy, a captured connection fails: %v", err)
			select {
			case got := <-app.Got:
				t.Fatalf("the app received %q with no proxy: the capture did not fail closed", got)
			case <-time.After(100 * time.Millisecond):
			}

			second := startProxyProc(t, bin, ag.socket)
			restarted := time.Now()
			served = allServed(t, pods, second)
			t.Logf("%d pods served again %s after the new process started (it started %s after the kill, the test's fail-closed check in between)",
				n, served.Sub(restarted).Round(time.Millisecond), restarted.Sub(killed).Round(time.Millisecond))
			if _, err := roundTripTo(t, pods[0], netip.AddrPortFrom(pods[1].IP4, appPort), "after"); err != nil {
				t.Fatalf("captured connection after the restart: %v", err)
			}
			if got := <-app.Got; got != pods[0].IP4.String()+" after" {
				t.Errorf("the app got %q after the restart", got)
			}
			second.kill()
		})
	}
}

// roundTripTo sends msg from pod p to dst and returns the reply line
// (proxytest's Serve answers "got <n> from <source>"), within 2 s.
func roundTripTo(t *testing.T, p *proxytest.Pod, dst netip.AddrPort, msg string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, dst)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	_ = c.CloseWrite()
	buf := make([]byte, 256)
	k, err := c.Read(buf)
	if k == 0 && err != nil {
		return "", err
	}
	return string(buf[:k]), nil
}
