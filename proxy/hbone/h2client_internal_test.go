package hbone

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// fakeServer is the test's end of a client engine's connection: the test
// plays the HBONE server with a Framer over loopback TCP, without TLS.
type fakeServer struct {
	t    testing.TB
	conn *net.TCPConn
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer
}

// testDialerConfig is a DialerConfig with the Dialer's defaults and
// keepalive pings out of the way.
func testDialerConfig() *DialerConfig {
	return &DialerConfig{
		StreamWindow: DefaultStreamWindow, ConnWindow: DefaultConnWindow,
		MaxFrameSize: DefaultDialerMaxFrameSize, HandshakeTimeout: DefaultHandshakeTimeout,
		PingInterval: time.Hour, PingTimeout: time.Hour,
	}
}

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(tb testing.TB) (a, b *net.TCPConn) {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		tb.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = c.Close(); _ = s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// newClientPair connects a client engine (cfg) over loopback TCP to a
// fakeServer and returns both; the client is not started. wg counts the
// engine's goroutines once started.
func newClientPair(tb testing.TB, cfg *DialerConfig) (*h2Client, *fakeServer, *sync.WaitGroup) {
	tb.Helper()
	cli, srv := tcpPair(tb)
	pc := &plainConn{TCPConn: cli}
	pc.setBeforeRead(func() {})
	wg := &sync.WaitGroup{}
	c := newH2Client(cfg, slog.New(slog.DiscardHandler), wg, &dialerCounters{}, pc, fuzzServer, "")
	fs := &fakeServer{t: tb, conn: srv, fr: http2.NewFramer(srv, srv)}
	fs.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fs.henc = hpack.NewEncoder(&fs.hbuf)
	return c, fs, wg
}

// start runs the client's start against the fake server, which reads the
// preface and answers with settings; it returns what start returned.
func (fs *fakeServer) start(c *h2Client, wg *sync.WaitGroup, settings ...http2.Setting) error {
	fs.t.Helper()
	wg.Add(2)
	done := make(chan error, 1)
	go func() { done <- c.start(context.Background()) }()
	var preface [len(clientPreface)]byte
	if _, err := io.ReadFull(fs.conn, preface[:]); err != nil || string(preface[:]) != clientPreface {
		fs.t.Fatalf("client preface %q (%v)", preface, err)
	}
	if err := fs.fr.WriteSettings(settings...); err != nil {
		fs.t.Fatal(err)
	}
	return <-done
}

// next reads the client's frames until one of type typ (skipping others).
func (fs *fakeServer) next(typ http2.FrameType) http2.Frame {
	fs.t.Helper()
	for {
		f, err := fs.fr.ReadFrame()
		if err != nil {
			fs.t.Fatalf("reading the client's frames for %v: %v", typ, err)
		}
		if f.Header().Type == typ {
			return f
		}
	}
}

// answer sends HEADERS with :status code on stream id.
func (fs *fakeServer) answer(id uint32, code string, end bool) {
	fs.t.Helper()
	fs.hbuf.Reset()
	_ = fs.henc.WriteField(hpack.HeaderField{Name: ":status", Value: code})
	if err := fs.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: fs.hbuf.Bytes(), EndHeaders: true, EndStream: end}); err != nil {
		fs.t.Fatal(err)
	}
}

// open dials a stream in the background and answers it 200; it returns
// the stream.
func (fs *fakeServer) open(c *h2Client) *Stream {
	fs.t.Helper()
	if !c.reserve() {
		fs.t.Fatal("no stream slot")
	}
	type result struct {
		st  *Stream
		err error
	}
	res := make(chan result, 1)
	go func() {
		st, err := c.openStream(context.Background(), netip.MustParseAddrPort("127.0.0.1:80"))
		res <- result{st, err}
	}()
	h := fs.next(http2.FrameHeaders).(*http2.MetaHeadersFrame)
	if h.PseudoValue("method") != "CONNECT" || h.PseudoValue("authority") != "127.0.0.1:80" ||
		h.PseudoValue("scheme") != "" || h.PseudoValue("path") != "" || h.StreamEnded() {
		fs.t.Fatalf("CONNECT request = %v", h.Fields)
	}
	fs.answer(h.StreamID, "200", false)
	r := <-res
	if r.err != nil {
		fs.t.Fatal(r.err)
	}
	return r.st
}

// TestClientHonoursServerSettings: the server's SETTINGS_MAX_CONCURRENT_STREAMS
// bounds the stream slots, its INITIAL_WINDOW_SIZE bounds what a Write sends
// before a WINDOW_UPDATE, and its MAX_FRAME_SIZE bounds every DATA frame.
func TestClientHonoursServerSettings(t *testing.T) {
	c, fs, wg := newClientPair(t, testDialerConfig())
	if err := fs.start(c, wg,
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 1},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1000},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 14},
	); err != nil {
		t.Fatal(err)
	}
	st := fs.open(c)
	if c.reserve() {
		t.Error("a second stream slot with SETTINGS_MAX_CONCURRENT_STREAMS 1")
	}
	msg := bytes.Repeat([]byte("0123456789"), 5000) // 50,000 bytes
	wrote := make(chan error, 1)
	go func() {
		_, err := st.Write(msg)
		wrote <- err
	}()
	var got []byte
	for len(got) < 1000 {
		d := fs.next(http2.FrameData).(*http2.DataFrame)
		got = append(got, d.Data()...)
	}
	select {
	case err := <-wrote:
		t.Fatalf("Write returned (%v) with 1000 of %d bytes sent: past the stream window", err, len(msg))
	case <-time.After(20 * time.Millisecond):
	}
	if len(got) != 1000 {
		t.Fatalf("%d bytes sent within a 1000-byte window", len(got))
	}
	if err := fs.fr.WriteWindowUpdate(st.id, uint32(len(msg)-1000)); err != nil {
		t.Fatal(err)
	}
	for len(got) < len(msg) {
		d := fs.next(http2.FrameData).(*http2.DataFrame)
		if len(d.Data()) > 1<<14 {
			t.Fatalf("DATA frame of %d bytes, the server's MAX_FRAME_SIZE is %d", len(d.Data()), 1<<14)
		}
		got = append(got, d.Data()...)
	}
	if err := <-wrote; err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("Write = %v, the server got %d bytes (equal %v)", err, len(got), bytes.Equal(got, msg))
	}
	// The slot comes back when the stream ends both ways.
	if err := st.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := fs.fr.WriteData(st.id, true, []byte("bye")); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(st); err != nil || string(b) != "bye" {
		t.Fatalf("read %q, %v; want bye, EOF", b, err)
	}
	for !c.reserve() { // the server's END_STREAM is processed asynchronously
		time.Sleep(time.Millisecond)
	}
	c.close(nil)
	wg.Wait()
}

// TestClientFlowControlViolation: a server that sends more DATA than the
// stream window we advertised gets GOAWAY FLOW_CONTROL_ERROR, and the
// stream fails with an error (not EOF).
func TestClientFlowControlViolation(t *testing.T) {
	cfg := testDialerConfig()
	cfg.StreamWindow = 1000
	c, fs, wg := newClientPair(t, cfg)
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	st := fs.open(c)
	if err := fs.fr.WriteData(st.id, false, make([]byte, 1001)); err != nil {
		t.Fatal(err)
	}
	ga := fs.next(http2.FrameGoAway).(*http2.GoAwayFrame)
	if ga.ErrCode != http2.ErrCodeFlowControl {
		t.Errorf("GOAWAY %v, want FLOW_CONTROL_ERROR", ga.ErrCode)
	}
	if _, err := io.ReadAll(st); err == nil || !errors.Is(err, errConnClosed) {
		t.Errorf("stream read after the violation = %v, want the connection's error", err)
	}
	wg.Wait()
	if !c.broken() {
		t.Error("connection not closed")
	}
}

// TestClientControlFlood: a server that keeps sending PINGs and never reads
// the acks loses its connection once 1 MiB of control frames is queued.
func TestClientControlFlood(t *testing.T) {
	c, fs, wg := newClientPair(t, testDialerConfig())
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	// A small send buffer at the client: unread acks pile up in the
	// engine's queue soon rather than in the kernel.
	if err := c.conn.(*plainConn).SetWriteBuffer(4096); err != nil {
		t.Fatal(err)
	}
	var pings bytes.Buffer
	pf := http2.NewFramer(&pings, nil)
	for range 1024 {
		_ = pf.WritePing(false, [8]byte{'f', 'l', 'o', 'o', 'd'})
	}
	var sent int
	for sent = 0; sent < 100<<20; sent += pings.Len() {
		if _, err := fs.conn.Write(pings.Bytes()); err != nil {
			break
		}
	}
	if sent >= 100<<20 {
		t.Fatalf("the client took %d bytes of PINGs without its acks being read and did not close", sent)
	}
	wg.Wait()
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if !c.flooded.Load() {
		t.Fatalf("connection closed (%v), not for the control flood", err)
	}
	if n := c.stat.snapshot().ControlFloods; n != 1 {
		t.Errorf("ControlFloods = %d, want 1", n)
	}
}

// TestClientGoAwayMidStream: GOAWAY with last-stream-id 1 fails stream 3
// (unprocessed: Dial retries it), stops new streams, lets stream 1 finish,
// and the connection closes after it.
func TestClientGoAwayMidStream(t *testing.T) {
	c, fs, wg := newClientPair(t, testDialerConfig())
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	one := fs.open(c)
	three := fs.open(c)
	if err := fs.fr.WriteGoAway(one.id, http2.ErrCodeNo, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := three.Read(make([]byte, 1)); !errors.Is(err, errGoAway) {
		t.Errorf("stream above GOAWAY's last stream: read = %v, want %v", err, errGoAway)
	}
	if c.reserve() || !c.unusable() {
		t.Error("new streams allowed after GOAWAY")
	}
	if _, err := one.Write([]byte("still")); err != nil {
		t.Fatal(err)
	}
	if d := fs.next(http2.FrameData).(*http2.DataFrame); string(d.Data()) != "still" {
		t.Errorf("server got %q", d.Data())
	}
	if err := one.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if err := fs.fr.WriteData(one.id, true, []byte("done")); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(one); err != nil || string(b) != "done" {
		t.Fatalf("stream below GOAWAY's last stream: read %q, %v; want done, EOF", b, err)
	}
	wg.Wait() // the connection closed with its last stream
}

// TestClientPingTimeout: a server that stops answering gets a PING, and
// the connection closes when PingTimeout passes without the ack; its
// streams fail with an error.
func TestClientPingTimeout(t *testing.T) {
	cfg := testDialerConfig()
	cfg.PingInterval, cfg.PingTimeout = 10*time.Millisecond, 10*time.Millisecond
	c, fs, wg := newClientPair(t, cfg)
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	st := fs.open(c)
	fs.next(http2.FramePing)
	if _, err := st.Read(make([]byte, 1)); err == nil || errors.Is(err, io.EOF) {
		t.Errorf("stream read after the ping timeout = %v, want an error", err)
	}
	wg.Wait()
	if !c.unusable() {
		t.Error("connection still usable")
	}
	if got := c.errs.pingTimeouts.Load(); got != 1 {
		t.Errorf("ping timeouts counted = %d, want 1", got)
	}
}

// TestClientStatusAndReset: a non-200 answer is a StatusError with its
// code; a server RST_STREAM fails the stream's reads and writes; a
// REFUSED_STREAM fails the dial with the retryable error.
func TestClientStatusAndReset(t *testing.T) {
	c, fs, wg := newClientPair(t, testDialerConfig())
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	dial := func(answer func(id uint32)) error {
		if !c.reserve() {
			t.Fatal("no stream slot")
		}
		errc := make(chan error, 1)
		go func() {
			_, err := c.openStream(context.Background(), netip.MustParseAddrPort("127.0.0.1:80"))
			errc <- err
		}()
		answer(fs.next(http2.FrameHeaders).Header().StreamID)
		return <-errc
	}
	err := dial(func(id uint32) { fs.answer(id, "502", true) })
	var se *StatusError
	if !errors.As(err, &se) || se.Code != 502 {
		t.Errorf("dial answered 502 = %v, want StatusError 502", err)
	}
	err = dial(func(id uint32) { _ = fs.fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) })
	if !errors.Is(err, errRefused) {
		t.Errorf("dial refused = %v, want %v", err, errRefused)
	}
	st := fs.open(c)
	if err := fs.fr.WriteData(st.id, false, []byte("partial")); err != nil {
		t.Fatal(err)
	}
	if err := fs.fr.WriteRSTStream(st.id, http2.ErrCodeInternal); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(st); err == nil {
		t.Errorf("read of a reset stream = %q, EOF; want an error", b)
	}
	if _, err := st.Write([]byte("x")); err == nil {
		t.Error("write to a stream the server reset succeeded")
	}
	c.close(nil)
	wg.Wait()
}

// observedStream is a StreamWriter over a Stream that counts what Copy
// wrote to it directly.
type observedStream struct {
	*Stream
	direct int
}

func (o *observedStream) HBONEStream() *Stream { return o.Stream }
func (o *observedStream) StreamWritten(n int)  { o.direct += n }

// TestCopyIntoStream: Copy of a socket into a Stream (through a
// StreamWriter) sends every byte in order as DATA frames of at most 16,375
// bytes against a 16 KiB MAX_FRAME_SIZE (frame and header fit one 16 KiB
// TLS record), and reports them to StreamWritten.
func TestCopyIntoStream(t *testing.T) {
	c, fs, wg := newClientPair(t, testDialerConfig())
	if err := fs.start(c, wg, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := fs.fr.WriteWindowUpdate(0, 1<<20); err != nil {
		t.Fatal(err)
	}
	st := fs.open(c)
	w, r := tcpPair(t)
	src := make([]byte, 300<<10)
	for i := range src {
		src[i] = byte(i * 7)
	}
	go func() {
		_, _ = w.Write(src)
		_ = w.CloseWrite()
	}()
	obs := &observedStream{Stream: st}
	copied := make(chan error, 1)
	go func() { copied <- Copy(obs, r) }()
	var got []byte
	for len(got) < len(src) {
		d := fs.next(http2.FrameData).(*http2.DataFrame)
		if n := len(d.Data()); n >= 1<<14 {
			t.Fatalf("DATA frame of %d bytes, want at most %d (a frame and its header in one record)", n, 1<<14-frameHeaderLen)
		}
		got = append(got, d.Data()...)
	}
	if err := <-copied; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, src) || obs.direct != len(src) {
		t.Fatalf("server got %d bytes (equal %v), StreamWritten told %d, want %d", len(got), bytes.Equal(got, src), obs.direct, len(src))
	}
	c.close(nil)
	wg.Wait()
}

// TestDialRetriesGoAway: a stream that a pooled connection's GOAWAY leaves
// unprocessed is retried once on a new connection (here one that cannot be
// opened), and the pooled connection is evicted and closes.
// pooledClient returns a Dialer whose pool holds one started client
// engine for req, connected to a fakeServer, and whose new connections
// fail, each counted in dials.
func pooledClient(t *testing.T) (d *Dialer, req Request, c *h2Client, fs *fakeServer, wg *sync.WaitGroup, dials chan struct{}) {
	t.Helper()
	dials = make(chan struct{}, 2)
	d, err := NewDialer(DialerConfig{
		Certs: noCerts{},
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			dials <- struct{}{}
			return nil, errors.New("no new connection in this test")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	c, fs, wg = newClientPair(t, &d.cfg)
	if err := fs.start(c, wg); err != nil {
		t.Fatal(err)
	}
	req = Request{Source: fuzzClient, Proxy: netip.MustParseAddrPort("127.0.0.1:15008"), Target: netip.MustParseAddrPort("127.0.0.1:80")}
	d.pool[poolKey{source: req.Source, proxy: req.Proxy}] = &poolEntry{conns: []*h2Client{c}}
	d.stat.connsPooled.Add(1)
	return d, req, c, fs, wg, dials
}

func TestDialRetriesGoAway(t *testing.T) {
	d, req, _, fs, wg, dials := pooledClient(t)
	go func() {
		fs.next(http2.FrameHeaders) // stream 1
		_ = fs.fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	}()
	if _, err := d.Dial(context.Background(), req); err == nil {
		t.Fatal("dial succeeded without a server")
	}
	if len(dials) != 1 {
		t.Errorf("%d new connections tried, want 1 (one retry)", len(dials))
	}
	if st := d.Stats(); st.ConnsEvicted != 1 || st.ConnsFailed != 1 || st.StreamsFailed != 1 || st.ConnsPooled != 0 {
		t.Errorf("dialer stats = %+v, want 1 evicted, 1 failed connection, 1 failed stream, none pooled", st)
	}
	wg.Wait() // the connection that sent GOAWAY closes: its loops end
}

// TestDialRetriesOnlyUnprocessed: Dial retries a stream on a new
// connection only when the server did not process it (RFC 9113 §8.7): a
// GOAWAY whose last stream ID is below it, REFUSED_STREAM, or a connection
// that took no new stream when its HEADERS were due. A stream the server
// may have delivered (reset with another code, its connection broken after
// the HEADERS went out, a GOAWAY above it, a status) fails without a
// retry: a retry would dial the target twice.
func TestDialRetriesOnlyUnprocessed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		server func(fs *fakeServer, id uint32)
		retry  bool
	}{
		{"GOAWAY below the stream", func(fs *fakeServer, id uint32) { _ = fs.fr.WriteGoAway(id-2, http2.ErrCodeNo, nil) }, true},
		{"REFUSED_STREAM", func(fs *fakeServer, id uint32) { _ = fs.fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) }, true},
		{"RST_STREAM INTERNAL_ERROR", func(fs *fakeServer, id uint32) { _ = fs.fr.WriteRSTStream(id, http2.ErrCodeInternal) }, false},
		{"RST_STREAM CANCEL", func(fs *fakeServer, id uint32) { _ = fs.fr.WriteRSTStream(id, http2.ErrCodeCancel) }, false},
		{"RST_STREAM PROTOCOL_ERROR", func(fs *fakeServer, id uint32) { _ = fs.fr.WriteRSTStream(id, http2.ErrCodeProtocol) }, false},
		{"connection closed after the HEADERS", func(fs *fakeServer, _ uint32) { _ = fs.conn.Close() }, false},
		{"GOAWAY above the stream, then closed", func(fs *fakeServer, id uint32) {
			_ = fs.fr.WriteGoAway(id, http2.ErrCodeNo, nil)
			_ = fs.conn.Close()
		}, false},
		{"GOAWAY INTERNAL_ERROR above the stream, then closed", func(fs *fakeServer, id uint32) {
			_ = fs.fr.WriteGoAway(id, http2.ErrCodeInternal, nil)
			_ = fs.conn.Close()
		}, false},
		{"status 503", func(fs *fakeServer, id uint32) { fs.answer(id, "503", true) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, req, c, fs, wg, dials := pooledClient(t)
			// A first stream, answered, so that a GOAWAY can name one below.
			if !c.reserve() {
				t.Fatal("no stream slot")
			}
			go func() {
				fs.answer(fs.next(http2.FrameHeaders).Header().StreamID, "200", false)
				tc.server(fs, fs.next(http2.FrameHeaders).Header().StreamID)
			}()
			if _, err := c.openStream(context.Background(), req.Target); err != nil {
				t.Fatal(err)
			}
			_, err := d.Dial(context.Background(), req)
			if err == nil {
				t.Fatal("dial succeeded")
			}
			if got := len(dials) == 1; got != tc.retry {
				t.Errorf("dial failed with %v after %d new connections tried; want a retry: %v", err, len(dials), tc.retry)
			}
			if st := d.Stats(); st.StreamsFailed != 1 {
				t.Errorf("dialer stats = %+v, want 1 failed stream", st)
			}
			_ = d.Close()
			c.close(nil) // evicted: it drains its first stream
			wg.Wait()
		})
	}
	t.Run("HEADERS write failed", func(t *testing.T) {
		d, req, c, _, wg, dials := pooledClient(t)
		// Our half of the connection is shut: the next write fails, the
		// read loop does not notice.
		if err := c.conn.(*plainConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		_, err := d.Dial(context.Background(), req)
		if err == nil || len(dials) != 1 {
			t.Errorf("dial failed with %v after %d new connections tried; want a retry", err, len(dials))
		}
		_ = d.Close()
		wg.Wait()
	})
	t.Run("connection taking no stream when the HEADERS are due", func(t *testing.T) {
		c, fs, wg := newClientPair(t, testDialerConfig())
		if err := fs.start(c, wg); err != nil {
			t.Fatal(err)
		}
		if !c.reserve() {
			t.Fatal("no stream slot")
		}
		c.drain() // the pool dropped it between reserve and openStream
		_, err := c.openStream(context.Background(), netip.MustParseAddrPort("127.0.0.1:80"))
		if !errors.Is(err, errNotSent) || !retryable(err) {
			t.Errorf("openStream on a draining connection = %v, want %v (retryable)", err, errNotSent)
		}
		wg.Wait()
	})
}
