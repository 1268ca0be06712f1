package proxy_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"aether.io/node/proxy/proxytest"
	"aether.io/node/test/harness"
)

// handoverEnv is a client and a server pod, both captured, the agent
// serving both, an echo app on the server and a hand-over socket.
type handoverEnv struct {
	bin, sock, flows string
	ag               *agent
	pods             []*proxytest.Pod
	dst              netip.AddrPort
}

func newHandoverEnv(t testing.TB, names ...string) *handoverEnv {
	t.Helper()
	if len(names) == 0 {
		names = []string{"client", "server"}
	}
	e := &handoverEnv{bin: filepath.Join(harness.BuildOwn(t, "aether-proxy"), "aether-proxy"), sock: filepath.Join(t.TempDir(), "run", "handover.sock")}
	e.flows = filepath.Join(filepath.Dir(e.sock), "flows.sock")
	e.pods = proxytest.New(t, names, names...).Pods
	e.ag = startAgent(t)
	for _, p := range e.pods {
		e.ag.addPod(t, p)
	}
	e.pods[1].Echo(t, 8080)
	e.dst = netip.AddrPortFrom(e.pods[1].IP4, 8080)
	return e
}

// start runs a proxy on the env's hand-over socket (flags of extra win).
func (e *handoverEnv) start(t testing.TB, extra ...string) *proxyProc {
	t.Helper()
	return e.startOn(t, e.ag.socket, extra...)
}

// startOn is start on the xDS socket xds.
func (e *handoverEnv) startOn(t testing.TB, xds string, extra ...string) *proxyProc {
	t.Helper()
	return startProxyProc(t, e.bin, xds, append([]string{"-handover-socket", e.sock, "-flows-socket", e.flows, "-log-level", "info", "-shutdown-drain", "10s"}, extra...)...)
}

// waitLog waits until the process logged s.
func (p *proxyProc) waitLog(t testing.TB, s string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if proxytest.WaitFor(ctx, func() bool { return strings.Contains(p.out.String(), s) }) != nil {
		t.Fatalf("aether-proxy did not log %q:\n%s", s, p.out.String())
	}
}

// waitExit waits for the process to exit and returns its exit code.
func (p *proxyProc) waitExit(t testing.TB, within time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(within):
		t.Fatalf("aether-proxy still runs after %s:\n%s", within, p.out.String())
		return -1
	}
}

func (p *proxyProc) term(t testing.TB) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
}

// load is a loop of short echoed connections from one pod to dst on
// several workers, counting those served and those that failed.
type load struct {
	ok, failed atomic.Int64
	mu         sync.Mutex
	errs       []error
	stop       chan struct{}
	wg         sync.WaitGroup
}

func startLoad(pod *proxytest.Pod, dst netip.AddrPort, workers int) *load {
	l := &load{stop: make(chan struct{})}
	for w := 0; w < workers; w++ {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				l.one(pod, dst, fmt.Sprintf("w%d-%d", w, i))
				time.Sleep(5 * time.Millisecond) // spares the client's ephemeral ports
			}
		}()
	}
	return l
}

// one connects, sends msg, and expects it echoed back then EOF.
func (l *load) one(pod *proxytest.Pod, dst netip.AddrPort, msg string) {
	err := echoOnce(pod, dst, msg)
	if err == nil {
		l.ok.Add(1)
		return
	}
	l.failed.Add(1)
	l.mu.Lock()
	if len(l.errs) < 5 {
		l.errs = append(l.errs, err)
	}
	l.mu.Unlock()
}

func echoOnce(pod *proxytest.Pod, dst netip.AddrPort, msg string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pod.Dial(ctx, dst)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	_ = c.CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q: want %q", got, msg)
	}
	return nil
}

// burst opens n connections at once (they queue in the listener's accept
// queue) and serves each; it returns the failures.
func (l *load) burst(pod *proxytest.Pod, dst netip.AddrPort, n int) {
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.one(pod, dst, fmt.Sprintf("burst-%d", i))
		}()
	}
	wg.Wait()
}

// synRetrans reads the pod netns's TcpExt TCPSynRetrans counter: SYNs sent
// again because none was answered (a connect that met no listener, in the
// capture divert, or a full accept queue).
func synRetrans(t *testing.T, pod *proxytest.Pod) int64 {
	t.Helper()
	var b []byte
	if err := pod.NS.Do(func() error {
		var err error
		b, err = os.ReadFile("/proc/thread-self/net/netstat")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	for i := 0; i+1 < len(lines); i++ {
		if !strings.HasPrefix(lines[i], "TcpExt:") || !strings.HasPrefix(lines[i+1], "TcpExt:") {
			continue
		}
		names, vals := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		for j, n := range names {
			if n == "TCPSynRetrans" && j < len(vals) {
				v, err := strconv.ParseInt(vals[j], 10, 64)
				if err != nil {
					t.Fatal(err)
				}
				return v
			}
		}
	}
	t.Fatal("no TcpExt TCPSynRetrans in /proc/net/netstat")
	return 0
}

func (l *load) end() (ok, failed int64, errs []error) {
	close(l.stop)
	l.wg.Wait()
	return l.ok.Load(), l.failed.Load(), l.errs
}

// TestHandoverUnderLoad: a successor started next to a serving proxy takes
// its listeners over while 16 workers loop short connections through the
// capture divert and bursts of 200 connects queue in the accept queue at
// the moment of the hand-over: every connection succeeds and is echoed,
// and the old proxy exits on its own once its connections ended. In the
// same run, today's stop-then-start (no hand-over socket) fails
// connections, which shows the load sees a gap.
func TestHandoverUnderLoad(t *testing.T) {
	e := newHandoverEnv(t)
	first := e.start(t)
	allServed(t, e.pods, first)
	retrans := synRetrans(t, e.pods[0])
	ld := startLoad(e.pods[0], e.dst, 16)
	time.Sleep(200 * time.Millisecond)
	second := e.start(t)
	for !strings.Contains(second.out.String(), "took over") {
		ld.burst(e.pods[0], e.dst, 200)
	}
	ld.burst(e.pods[0], e.dst, 200)
	if code := first.waitExit(t, 30*time.Second); code != 0 {
		t.Fatalf("the old proxy exited with %d:\n%s", code, first.out.String())
	}
	ld.burst(e.pods[0], e.dst, 200)
	ok, failed, errs := ld.end()
	syns := synRetrans(t, e.pods[0]) - retrans
	t.Logf("hand-over: %d connections served, %d failed %v, %d SYNs sent again", ok, failed, errs, syns)
	if failed != 0 || ok == 0 || syns != 0 {
		t.Fatalf("hand-over under load: %d connections served, %d failed, %d SYNs unanswered (want none): %v\nold:\n%s\nnew:\n%s", ok, failed, syns, errs, first.out.String(), second.out.String())
	}
	second.waitLog(t, "hand-over done")
	allServed(t, e.pods, second)

	// Baseline: stop, then start, as without a hand-over. Connects in the
	// gap meet no listener behind the divert: their SYNs go unanswered
	// and are sent again a second later, when most meet the new proxy.
	retrans = synRetrans(t, e.pods[0])
	ld = startLoad(e.pods[0], e.dst, 16)
	time.Sleep(200 * time.Millisecond)
	second.term(t)
	second.waitExit(t, 30*time.Second)
	third := startProxyProc(t, e.bin, e.ag.socket, "-flows-socket", e.flows)
	allServed(t, e.pods, third)
	time.Sleep(200 * time.Millisecond)
	ok, failed, errs = ld.end()
	syns = synRetrans(t, e.pods[0]) - retrans
	t.Logf("stop-then-start: %d connections served, %d failed %v, %d SYNs sent again", ok, failed, errs, syns)
	if failed+syns == 0 {
		t.Fatalf("stop-then-start failed or stalled no connection (%d served): the load does not see a gap", ok)
	}
}

// TestHandoverSuccessorFails: a successor that took the sockets but fails
// before its ack, by exiting with an error (it cannot sync with the agent
// within -handover-timeout) or by SIGKILL, leaves the old proxy serving
// every pod, with no connection failed meanwhile; a later successor then
// takes over as usual.
func TestHandoverSuccessorFails(t *testing.T) {
	e := newHandoverEnv(t)
	first := e.start(t)
	allServed(t, e.pods, first)
	ld := startLoad(e.pods[0], e.dst, 8)
	dead := filepath.Join(t.TempDir(), "no-agent.sock")

	failing := e.startOn(t, dead, "-handover-timeout", "500ms")
	failing.waitLog(t, "took over")
	if code := failing.waitExit(t, 30*time.Second); code == 0 {
		t.Fatalf("a successor that cannot sync exited 0:\n%s", failing.out.String())
	}
	killed := e.startOn(t, dead)
	killed.waitLog(t, "took over")
	killed.kill()
	time.Sleep(200 * time.Millisecond)
	select {
	case <-first.done:
		t.Fatalf("the old proxy exited after a failed hand-over:\n%s", first.out.String())
	default:
	}
	ok, failed, errs := ld.end()
	t.Logf("two failed successors: %d connections served, %d failed %v", ok, failed, errs)
	if failed != 0 || ok == 0 {
		t.Fatalf("with failed successors: %d connections served, %d failed (want none): %v", ok, failed, errs)
	}
	allServed(t, e.pods, first)
	if !bytes.Contains([]byte(first.out.String()), []byte("hand-over to a successor failed")) {
		t.Errorf("the old proxy did not log the failed hand-overs:\n%s", first.out.String())
	}

	next := e.start(t)
	next.waitLog(t, "hand-over done")
	if code := first.waitExit(t, 30*time.Second); code != 0 {
		t.Fatalf("the old proxy exited with %d after the hand-over:\n%s", code, first.out.String())
	}
	allServed(t, e.pods, next)
	if err := echoOnce(e.pods[0], e.dst, "after"); err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("connection after the hand-over: %v", err)
	}
}

// seqApp serves port on the pod: it reads 8-byte sequence numbers, checks
// that each is the next one (no byte lost or duplicated on the way in),
// echoes them, and reports how its read ended (nil: a FIN).
func seqApp(t *testing.T, pod *proxytest.Pod, port uint16) chan error {
	ends := make(chan error, 8)
	pod.Handle(t, port, func(c net.Conn) {
		var want uint64
		buf := make([]byte, 8)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				ends <- err
				return
			}
			if got := binary.BigEndian.Uint64(buf); got != want {
				ends <- fmt.Errorf("app read sequence %d, want %d", got, want)
				return
			}
			want++
			if _, err := c.Write(buf); err != nil {
				ends <- err
				return
			}
		}
	})
	return ends
}

// seqConn sends sequence numbers on a connection every millisecond and
// checks their echo; echoed counts them, end is how reading ended.
type seqConn struct {
	c      *net.TCPConn
	echoed atomic.Uint64
	end    chan error
}

func dialSeq(t *testing.T, pod *proxytest.Pod, dst netip.AddrPort) *seqConn {
	t.Helper()
	c, err := pod.Dial(context.Background(), dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	s := &seqConn{c: c, end: make(chan error, 1)}
	stop := make(chan struct{})
	go func() {
		defer close(stop)
		buf := make([]byte, 8)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				s.end <- err
				return
			}
			if got, want := binary.BigEndian.Uint64(buf), s.echoed.Load(); got != want {
				s.end <- fmt.Errorf("echoed sequence %d, want %d", got, want)
				return
			}
			s.echoed.Add(1)
		}
	}()
	go func() {
		buf := make([]byte, 8)
		for i := uint64(0); ; i++ {
			binary.BigEndian.PutUint64(buf, i)
			if _, err := c.Write(buf); err != nil {
				return
			}
			select {
			case <-stop: // the other side finished: close cleanly
				_ = c.CloseWrite()
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	return s
}

// flowing waits until the connection echoed more than it had.
func (s *seqConn) flowing(t *testing.T, what string) {
	t.Helper()
	n := s.echoed.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if proxytest.WaitFor(ctx, func() bool { return s.echoed.Load() > n+50 }) != nil {
		t.Fatalf("%s: the connection stopped at %d echoed", what, s.echoed.Load())
	}
}

// TestHandoverLongLived: a connection streaming sequence numbers through
// the old proxy keeps flowing across the hand-over with every number
// echoed once and in order; at the old proxy's drain deadline it ends
// with a FIN on both sides (the client and the app each read EOF, no
// reset), and a connection opened after the hand-over, through the
// successor, flows on after the old proxy exited.
func TestHandoverLongLived(t *testing.T) {
	e := newHandoverEnv(t)
	ends := seqApp(t, e.pods[1], 8081)
	dst := netip.AddrPortFrom(e.pods[1].IP4, 8081)
	first := e.start(t, "-shutdown-drain", "2s")
	allServed(t, e.pods, first)
	old := dialSeq(t, e.pods[0], dst)
	old.flowing(t, "before the hand-over")

	second := e.start(t)
	second.waitLog(t, "hand-over done")
	old.flowing(t, "after the hand-over")
	fresh := dialSeq(t, e.pods[0], dst)
	fresh.flowing(t, "through the successor")

	select {
	case err := <-old.end:
		if err != nil {
			t.Fatalf("the connection older than the drain deadline ended with %v, want a FIN (EOF)", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the connection did not end at the drain deadline:\n%s", first.out.String())
	}
	select {
	case err := <-ends:
		if err != nil {
			t.Fatalf("the app's side of the drained connection ended with %v, want a FIN (EOF)", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the app's side of the drained connection did not end")
	}
	t.Logf("drained connection: %d sequence numbers echoed, then a FIN both ways", old.echoed.Load())
	if code := first.waitExit(t, 10*time.Second); code != 0 {
		t.Fatalf("the old proxy exited with %d:\n%s", code, first.out.String())
	}
	fresh.flowing(t, "after the old proxy exited")
	select {
	case err := <-fresh.end:
		t.Fatalf("the connection through the successor ended: %v", err)
	default:
	}
}
