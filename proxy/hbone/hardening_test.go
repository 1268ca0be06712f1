package hbone_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"

	"aether.io/node/proxy/hbone"
)

// priorityUntilClosed sends a PRIORITY frame every interval until a write
// fails (the server closed the connection: true) or ctx ends (false).
func priorityUntilClosed(ctx context.Context, rc *rawClient, interval time.Duration) bool {
	for ctx.Err() == nil {
		if err := rc.fr.WritePriority(1, http2.PriorityParam{Weight: 15}); err != nil {
			return true
		}
		select {
		case <-time.After(interval):
		case <-ctx.Done():
		}
	}
	return false
}

// TestWriteTimeoutClosesStalledConn: a client that grants large windows,
// opens a stream to an app that writes without end, never reads and sends
// a PRIORITY every 100 ms used to block the server's writer forever with
// the write lock held. Every write now has a deadline: the connection is
// closed and counted once WriteTimeout passes without the write finishing.
func TestWriteTimeoutClosesStalledConn(t *testing.T) {
	e := newBoundsEnv(t, func(c *hbone.ServerConfig) {
		c.WriteTimeout = 300 * time.Millisecond
		c.PingInterval = time.Hour // only the write deadline can end it
	})
	rc := dialRaw(t, e.env, "127.0.0.1", http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	_ = rc.c.NetConn().(*net.TCPConn).SetReadBuffer(4 << 10)
	if err := rc.fr.WriteWindowUpdate(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := rc.connect(1, e.flood); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if !priorityUntilClosed(ctx, rc, 100*time.Millisecond) {
		t.Fatal("a client that never reads kept its connection for 20 s (WriteTimeout 300 ms)")
	}
	waitFor(t, func() bool { return e.srv.Stats().WriteTimeouts == 1 })
}

// TestPriorityFloodDoesNotKeepAlive: frames the client sends do not show
// that it reads what the server sends: a client that sends a PRIORITY
// every 10 ms and never reads gets a PING after PingInterval (no ack came),
// and loses its connection when the ack does not come in PingTimeout.
func TestPriorityFloodDoesNotKeepAlive(t *testing.T) {
	e := newBoundsEnv(t, func(c *hbone.ServerConfig) {
		c.PingInterval, c.PingTimeout = time.Second, 500*time.Millisecond
	})
	rc := dialRaw(t, e.env, "127.0.0.1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !priorityUntilClosed(ctx, rc, 10*time.Millisecond) {
		t.Fatal("a client that sends PRIORITY frames and never reads kept its connection for 10 s (ping 1 s, timeout 500 ms)")
	}
}

// TestConnCapPerSource: one source address that opens 70 TCP connections
// to :15008 and never handshakes keeps 64 of them (the per-source cap,
// DefaultMaxConnsPerSource, counted from accept); the other 6 are closed at
// once, and another source still connects and moves data.
func TestConnCapPerSource(t *testing.T) {
	e := newBoundsEnv(t, nil)
	const n = 70
	conns := make([]net.Conn, 0, n)
	for range n {
		c, err := dialFrom("127.0.0.3")(context.Background(), "tcp", e.proxy.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		conns = append(conns, c)
	}
	waitFor(t, func() bool { return e.srv.Stats().Accepted == n })
	// A connection closed at accept reads EOF at once; one kept waits for
	// its handshake (HandshakeTimeout: 10 s).
	var closed, open atomic.Int32
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := c.Read(make([]byte, 1))
			if errors.Is(err, os.ErrDeadlineExceeded) {
				open.Add(1)
			} else {
				closed.Add(1)
			}
		}()
	}
	victim(t, e.env)
	wg.Wait()
	if closed.Load() != n-hbone.DefaultMaxConnsPerSource || open.Load() != hbone.DefaultMaxConnsPerSource {
		t.Fatalf("of %d connections from one source: %d closed at accept, %d kept; want %d and %d",
			n, closed.Load(), open.Load(), n-hbone.DefaultMaxConnsPerSource, hbone.DefaultMaxConnsPerSource)
	}
	if got := e.srv.Stats().ConnsRejected; got != n-hbone.DefaultMaxConnsPerSource {
		t.Fatalf("ConnsRejected = %d, want %d", got, n-hbone.DefaultMaxConnsPerSource)
	}
}

// countDeliveries wraps e's Deliver to count its calls.
func countDeliveries(n *atomic.Int32) func(*hbone.ServerConfig) {
	return func(c *hbone.ServerConfig) {
		c.Deliver = func(ctx context.Context, _ spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			n.Add(1)
			var d net.Dialer
			return d.DialContext(ctx, "tcp", target.String())
		}
	}
}

// TestRapidResetNotDelivered: 200 streams each reset in the same write as
// its HEADERS (a rapid reset) never reach Deliver (no netns socket, no SYN
// to the app); a stream that is not reset is delivered.
func TestRapidResetNotDelivered(t *testing.T) {
	var delivered atomic.Int32
	e := newEnv(t, countDeliveries(&delivered))
	rc := dialRaw(t, e, "127.0.0.1")
	var buf bytes.Buffer
	pair := http2.NewFramer(&buf, nil)
	const resets = 200
	for i := range resets {
		id := uint32(2*i + 1)
		buf.Reset()
		_ = pair.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: rc.block(e.target), EndHeaders: true})
		_ = pair.WriteRSTStream(id, http2.ErrCodeCancel)
		if _, err := rc.c.Write(buf.Bytes()); err != nil {
			t.Fatal(err)
		}
	}
	last := uint32(2*resets + 1)
	if err := rc.connect(last, e.target); err != nil {
		t.Fatal(err)
	}
	_ = rc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := rc.fr.ReadFrame()
		if err != nil {
			t.Fatalf("no answer to the stream that was not reset: %v", err)
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok && h.StreamID == last {
			if s := h.PseudoValue("status"); s != "200" {
				t.Fatalf("status %q, want 200", s)
			}
			break
		}
	}
	if got := delivered.Load(); got != 1 {
		t.Fatalf("%d deliveries for %d streams reset with their HEADERS and one that was not, want 1", got, resets)
	}
}

// countingHandler counts the records of one level.
type countingHandler struct {
	level slog.Level
	n     *atomic.Int32
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level == h.level {
		h.n.Add(1)
	}
	return nil
}
func (h countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countingHandler) WithGroup(string) slog.Handler      { return h }

// TestDeliverFailureLogRateLimited: 200 streams whose delivery fails log
// at most one ERROR line per second (with the count held back), not one
// each.
func TestDeliverFailureLogRateLimited(t *testing.T) {
	var errorsLogged atomic.Int32
	e := newEnv(t, func(c *hbone.ServerConfig) {
		c.Deliver = refuse
		c.Logger = slog.New(countingHandler{level: slog.LevelError, n: &errorsLogged})
	})
	start := time.Now()
	rc := dialRaw(t, e, "127.0.0.1")
	go func() { _, _ = io.Copy(io.Discard, rc.c) }() // the answers
	// Two batches (one ending, one starting) stay within MaxConcurrentStreams.
	const n, batch = 200, 20
	for i := range n {
		if err := rc.connect(uint32(2*i+1), e.target); err != nil {
			t.Fatal(err)
		}
		if (i+1)%batch == 0 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			for e.srv.Stats().StreamsDeliverFailed < uint64(i+1) && ctx.Err() == nil {
				time.Sleep(time.Millisecond)
			}
			cancel()
			if st := e.srv.Stats(); st.StreamsDeliverFailed < uint64(i+1) {
				t.Fatalf("after %d streams: %+v", i+1, st)
			}
		}
	}
	allowed := 1 + int32(time.Since(start)/time.Second) + 1
	if got := errorsLogged.Load(); got > allowed {
		t.Fatalf("%d ERROR lines for %d failed deliveries in %s, want at most %d (one per second)", got, n, time.Since(start), allowed)
	}
}

// readUntilGoAway reads frames until a GOAWAY (its code) or the connection
// ends (an error).
func readUntilGoAway(rc *rawClient) (http2.ErrCode, error) {
	_ = rc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := rc.fr.ReadFrame()
		if err != nil {
			return 0, err
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			return g.ErrCode, nil
		}
	}
}

// TestTooManySettingsClosesConn: a SETTINGS frame of 101 entries (each
// applied under the engine's lock, INITIAL_WINDOW_SIZE walking every
// stream) ends the connection with GOAWAY PROTOCOL_ERROR, as x/net's
// server does.
func TestTooManySettingsClosesConn(t *testing.T) {
	e := newEnv(t, nil)
	rc := dialRaw(t, e, "127.0.0.1")
	var s []http2.Setting
	for i := range 101 {
		s = append(s, http2.Setting{ID: http2.SettingID(0x100 + i), Val: 1}) // unknown IDs: ignored one by one
	}
	if err := rc.fr.WriteSettings(s...); err != nil {
		t.Fatal(err)
	}
	code, err := readUntilGoAway(rc)
	if err != nil || code != http2.ErrCodeProtocol {
		t.Fatalf("after SETTINGS of 101 entries: GOAWAY %s, %v; want GOAWAY PROTOCOL_ERROR", code, err)
	}
	waitFor(t, func() bool { return e.srv.Stats().ProtocolErrors == 1 }) // counted before the close
}

// TestContinuationFloodClosesConn: a HEADERS without END_HEADERS followed
// by empty CONTINUATION frames (nothing for x/net's header-list check to
// count) ends the connection with GOAWAY PROTOCOL_ERROR once the block
// passes 144 KiB on the wire, instead of holding the read loop as long as
// the client sends them.
func TestContinuationFloodClosesConn(t *testing.T) {
	e := newEnv(t, nil)
	rc := dialRaw(t, e, "127.0.0.1")
	if err := rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x82}}); err != nil {
		t.Fatal(err)
	}
	var burst bytes.Buffer
	bf := http2.NewFramer(&burst, nil)
	for range 1000 {
		_ = bf.WriteContinuation(1, false, nil)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go func() {
		for range 100 { // 900 KB of empty CONTINUATION frames at most
			if ctx.Err() != nil {
				return
			}
			if _, err := rc.c.Write(burst.Bytes()); err != nil {
				return
			}
		}
	}()
	code, err := readUntilGoAway(rc)
	if err != nil || code != http2.ErrCodeProtocol {
		t.Fatalf("after a flood of empty CONTINUATION frames: GOAWAY %s, %v; want GOAWAY PROTOCOL_ERROR", code, err)
	}
	if got := e.srv.Stats().ProtocolErrors; got != 1 {
		t.Errorf("protocol errors counted = %d, want 1", got)
	}
}
