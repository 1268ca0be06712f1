package hbone_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

// pipeListener hands the server ends of net.Pipe connections to Serve: a
// pipe has no buffer, so a peer that stops reading stalls the server's next
// write at once (a TCP socket would absorb megabytes first).
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (*pipeListener) Addr() net.Addr { return &net.UnixAddr{Name: "pipe", Net: "pipe"} }

// dial returns the client end of a new pipe whose server end Serve accepts.
func (l *pipeListener) dial(ctx context.Context) (net.Conn, error) {
	cli, srv := net.Pipe()
	select {
	case l.conns <- srv:
		return cli, nil
	case <-l.done:
		return nil, net.ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Apps behind the fuzzed server, by the :authority port of a CONNECT.
const (
	appStatus  = 0 // Deliver fails with a StatusError: 502
	appRefused = 1 // Deliver fails: 503
	appEcho    = 2 // echoes until EOF
	appDeaf    = 3 // never reads (the upstream stalls the stream at once)
	appFlood   = 4 // writes without end, never reads
	appClose   = 5 // closes at once
	appStall   = 6 // reads once, then stops reading
	numApps    = 7
)

// tlsScript builds fuzz inputs for FuzzServerTLS (see its op codes).
type tlsScript struct{ b []byte }

func script(flags byte) *tlsScript { return &tlsScript{b: []byte{flags}} }

func (s *tlsScript) op(code byte, args ...byte) *tlsScript {
	s.b = append(append(s.b, code), args...)
	return s
}

func (s *tlsScript) connect(app byte, end bool) *tlsScript {
	if end {
		app |= 0x80
	}
	return s.op(opConnect, app)
}

func (s *tlsScript) data(stream, n64 byte, end bool) *tlsScript {
	if end {
		stream |= 0x80
	}
	return s.op(opData, stream, n64)
}

func (s *tlsScript) raw(p []byte) *tlsScript {
	for len(p) > 0 {
		n := min(len(p), 255)
		s.op(opRaw, byte(n))
		s.b = append(s.b, p[:n]...)
		p = p[n:]
	}
	return s
}

func u32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

// Op codes of FuzzServerTLS's script.
const (
	opRaw      = iota // n, n bytes: written as they are (any frames)
	opConnect         // a: CONNECT on the next odd stream to app a&0x7f%numApps; END_STREAM if a&0x80
	opData            // s, n: DATA of n*64 bytes on stream 2*(s&7)+1; END_STREAM if s&0x80
	opPing            // a PING
	opSettings        // id, 4 bytes: one SETTINGS entry (any id and value)
	opWindow          // s, 4 bytes: WINDOW_UPDATE on stream 2*(s&7)+1, or 0 if s&0x80
	opReset           // s: RST_STREAM on stream 2*(s&7)+1, code s>>4
	opStall           // the client stops reading
	opResume          // the client reads again
	opShutdown        // Server.Shutdown starts, its grace from the flags
	opWait            // wait for the server's next PING (keepalive), or a little
	opClose           // the client closes the connection (the script ends)
	numOps
)

// FuzzServerTLS drives the server engine as production runs it: Serve
// accepts the connection, the mTLS handshake runs over the record batcher
// and the engine reads and writes TLS records through it. The input is a
// script: a flags byte (bit 0: the client acks the server's PINGs; bit 1:
// SETTINGS_INITIAL_WINDOW_SIZE 0, so no DATA may flow until a
// WINDOW_UPDATE; bits 2-3: Shutdown's grace, from none to 1 s), then ops
// (above): frames, valid or not, to apps that echo, never read, flood,
// close or stall; the client stalling and resuming its reads; keepalive
// waits (PingInterval 2 ms, PingTimeout and WriteTimeout 20 ms, so a
// stalled client loses its connection); Shutdown and close at any point.
//
// After each input, once the client closed and Shutdown returned: no
// panic; every goroutine the engine (and the apps) started has ended; the
// Budget holds no connection, window, source or send buffer; StreamsActive
// is 0; and the live heap grew by less than 4 MiB (and by less than 32 MiB
// while the connection was still open: one connection's bounds, README
// "Memory and connection bounds", are about 8 MiB here).
func FuzzServerTLS(f *testing.F) {
	seeds := []*tlsScript{
		script(1).connect(appEcho, false).data(0, 4, false).data(0, 1, true),
		script(1).connect(appEcho, false).data(0, 255, false).op(opWait).data(0, 255, true).op(opWait),
		script(0).connect(appFlood, false).op(opStall).op(opWait).op(opWait),
		script(1).connect(appFlood, false).op(opWait).op(opStall).op(opWait).op(opResume).op(opWait),
		script(1).connect(appDeaf, false).data(0, 255, false).data(0, 255, false).data(0, 255, false).op(opWait),
		script(1).connect(appStall, false).data(0, 255, false).data(0, 255, false).op(opWait),
		script(2).connect(appFlood, false).op(opWait).op(opWindow, 0, 0, 0, 0x40, 0).op(opWait),
		script(2).connect(appFlood, false).op(opWindow, 0x80, 0x7f, 0xff, 0xff, 0xff).op(opWindow, 0x80, 0x7f, 0xff, 0xff, 0xff),
		script(1).connect(appEcho, false).connect(appFlood, false).op(opShutdown).data(0, 3, true).op(opWait),
		script(1|3<<2).connect(appEcho, false).op(opShutdown).data(0, 3, false).op(opWait).data(0, 3, true).op(opWait),
		script(0).connect(appFlood, false).connect(appDeaf, false).op(opShutdown).op(opStall).op(opWait),
		script(1|2<<2).connect(appDeaf, false).data(0, 10, false).op(opShutdown).op(opWait).op(opClose),
		script(1).connect(appClose, false).connect(appRefused, false).connect(appStatus, true).op(opWait),
		script(1).connect(appEcho, false).op(opReset, 0x80).data(0, 1, false).op(opWait),
		script(0).op(opWait).op(opWait).op(opWait),
		script(1).op(opPing).op(opPing).op(opStall).op(opPing).op(opWait),
		script(1).op(opSettings, append([]byte{byte(http2.SettingInitialWindowSize)}, u32(1<<31)...)...).connect(appEcho, false),
		script(1).op(opSettings, append([]byte{byte(http2.SettingMaxFrameSize)}, u32(1)...)...).op(opSettings, append([]byte{0x99}, u32(7)...)...),
		script(1).connect(appEcho, false).data(0, 2, false).op(opClose),
	}
	{
		var b, hb bytes.Buffer
		fr := http2.NewFramer(&b, nil)
		fr.AllowIllegalWrites = true
		henc := hpack.NewEncoder(&hb)
		_ = henc.WriteField(hpack.HeaderField{Name: ":method", Value: "GET"})
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
		_ = fr.WriteData(1, true, []byte("x"))
		_ = fr.WriteData(0, false, []byte("stream 0"))
		seeds = append(seeds, script(1).raw(b.Bytes()))
		b.Reset()
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x82}})
		_ = fr.WriteContinuation(3, true, []byte{0x84})
		seeds = append(seeds, script(1).raw(b.Bytes()))
	}
	for _, s := range seeds {
		f.Add(s.b)
	}

	ca, err := hbonetest.NewCA(td)
	if err != nil {
		f.Fatal(err)
	}
	certs := hbonetest.NewCerts(ca.Bundle())
	for _, id := range []spiffeid.ID{serverID, clientID} {
		svid, err := ca.ValidSVID(id)
		if err != nil {
			f.Fatal(err)
		}
		certs.SetSVID(svid)
	}
	svid, _ := certs.SVID(clientID)
	clientTLS := &tls.Config{
		InsecureSkipVerify: true, //nolint:gosec // only the server's protocol handling is tested
		Certificates:       []tls.Certificate{tlsCert(svid.Certificates, svid.PrivateKey)},
		MinVersion:         tls.VersionTLS13,
		NextProtos:         []string{hbone.ALPN},
	}

	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		goroutines := runtime.NumGoroutine()
		heap := liveHeap()
		r := runTLSScript(t, certs, clientTLS, in)
		if during := liveHeap(); during > heap+32<<20 {
			t.Errorf("live heap grew by %d bytes with one connection open, want < 32 MiB", during-heap)
		}
		r.finish(t)

		if st := r.budget.Stats(); st != (hbone.BudgetStats{}) {
			t.Errorf("budget still holds %+v after shutdown, want nothing", st)
		}
		if n := r.srv.Stats().StreamsActive; n != 0 {
			t.Errorf("StreamsActive = %d after shutdown, want 0", n)
		}
		// Shutdown waited for the engine's goroutines; timers that fired
		// just before may still be returning.
		for deadline := time.Now().Add(10 * time.Second); runtime.NumGoroutine() > goroutines; {
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				t.Fatalf("%d goroutines before the input, %d after it ended:\n%s",
					goroutines, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
			}
			runtime.Gosched()
			time.Sleep(time.Millisecond)
		}
		if after := liveHeap(); after > heap+4<<20 {
			t.Errorf("live heap grew by %d bytes after the input ended, want < 4 MiB", after-heap)
		}
	})
}

// tlsRun is one FuzzServerTLS input in progress.
type tlsRun struct {
	srv      *hbone.Server
	budget   *hbone.Budget
	ln       *pipeListener
	served   chan error
	apps     sync.WaitGroup
	stopApps chan struct{}
	grace    time.Duration

	conn     *tls.Conn
	reader   chan struct{} // closed when the client's reader returns
	parseErr func() error  // the reader's error, once it returned
	shutdown chan error    // Shutdown's result, once an op started it
}

// runTLSScript serves one connection and plays the script in on it; the
// connection and the server are still up when it returns.
func runTLSScript(t *testing.T, certs hbone.Certs, clientTLS *tls.Config, in []byte) *tlsRun {
	t.Helper()
	budget, err := hbone.NewBudget(hbone.BudgetConfig{Window: 1 << 20, WindowPerSource: 1 << 20, SendBufs: 8, SendBufsPerSource: 4})
	if err != nil {
		t.Fatal(err)
	}
	r := &tlsRun{budget: budget, ln: newPipeListener(), served: make(chan error, 1), stopApps: make(chan struct{})}
	r.grace = [4]time.Duration{0, time.Millisecond, 20 * time.Millisecond, time.Second}[in[0]>>2&3]
	r.srv, err = hbone.NewServer(hbone.ServerConfig{
		Identity: serverID, Certs: certs, Deliver: r.deliver, Budget: budget,
		HandshakeTimeout: 5 * time.Second, IdleTimeout: 50 * time.Millisecond,
		MaxConcurrentStreams: 8, StreamWindow: 1 << 16, ConnWindow: 1 << 18,
		PingInterval: 2 * time.Millisecond, PingTimeout: 20 * time.Millisecond,
		WriteTimeout: 20 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() { r.served <- r.srv.Serve(r.ln) }()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := r.ln.dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Every write of the client fails after this (a server that stops
	// reading must not hang the input; closing it is the server's right).
	_ = raw.SetWriteDeadline(time.Now().Add(2 * time.Second))
	r.conn = tls.Client(raw, clientTLS)
	if err := r.conn.HandshakeContext(ctx); err != nil {
		t.Fatalf("handshake: %v", err)
	}

	var wmu sync.Mutex
	var wbuf bytes.Buffer
	wfr := http2.NewFramer(&wbuf, nil)
	wfr.AllowIllegalWrites = true
	// write sends what the framer call f wrote, as one TLS write.
	write := func(f func()) bool {
		wmu.Lock()
		defer wmu.Unlock()
		wbuf.Reset()
		f()
		_, err := r.conn.Write(wbuf.Bytes())
		return err == nil
	}

	// The reader: parses every frame (the server must send valid
	// HTTP/2), acks PINGs if told, stops while stalled.
	ackPings := in[0]&1 == 1
	var stalled atomic.Bool
	resume := make(chan struct{}, 1)
	pings := make(chan struct{}, 1)
	r.reader = make(chan struct{})
	var parseErr error
	go func() {
		defer close(r.reader)
		fr := http2.NewFramer(nil, r.conn)
		fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		for {
			for stalled.Load() {
				<-resume
			}
			f, err := fr.ReadFrame()
			if err != nil {
				// The end, or a close mid-frame (a write that timed
				// out); a frame that does not parse is an error.
				var ne net.Error
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.ErrClosedPipe) && !errors.As(err, &ne) &&
					!strings.Contains(err.Error(), "use of closed") {
					parseErr = err
				}
				return
			}
			if p, ok := f.(*http2.PingFrame); ok && !p.IsAck() {
				if ackPings {
					data := p.Data
					write(func() { _ = wfr.WritePing(true, data) })
				}
				select {
				case pings <- struct{}{}:
				default:
				}
			}
		}
	}()

	settings := []http2.Setting{}
	if in[0]&2 != 0 {
		settings = append(settings, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0})
	}
	ok := write(func() {
		wbuf.WriteString(http2.ClientPreface)
		_ = wfr.WriteSettings(settings...)
	})
	next := uint32(1)
	in = in[1:]
	arg := func(n int) []byte {
		a := make([]byte, n)
		copy(a, in)
		in = in[min(n, len(in)):]
		return a
	}
	ops := frameOps{write: write, fr: wfr}
	for ok && len(in) > 0 {
		op := in[0] % numOps
		in = in[1:]
		switch op {
		case opRaw:
			p := arg(int(arg(1)[0]))
			ok = write(func() { wbuf.Write(p) })
		case opConnect:
			a := arg(1)[0]
			auth := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(a&0x7f)%numApps).String()
			id := next
			next += 2
			ok = write(func() {
				var hb bytes.Buffer
				henc := hpack.NewEncoder(&hb)
				_ = henc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
				_ = henc.WriteField(hpack.HeaderField{Name: ":authority", Value: auth})
				_ = wfr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndStream: a&0x80 != 0, EndHeaders: true})
			})
		case opData:
			ok = ops.data(arg(2))
		case opPing:
			ok = write(func() { _ = wfr.WritePing(false, [8]byte{byte(next)}) })
		case opSettings:
			ok = ops.settings(arg(5))
		case opWindow:
			ok = ops.window(arg(5))
		case opReset:
			ok = ops.reset(arg(1)[0])
		case opStall:
			stalled.Store(true)
		case opResume:
			stalled.Store(false)
			select {
			case resume <- struct{}{}:
			default:
			}
		case opShutdown:
			if r.shutdown == nil {
				r.shutdown = make(chan error, 1)
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), r.grace)
					defer cancel()
					r.shutdown <- r.srv.Shutdown(ctx)
				}()
			}
		case opWait:
			// Bounded: a connection the server closed sends no PING.
			select {
			case <-pings:
			case <-r.reader:
			case <-time.After(20 * time.Millisecond):
			}
		case opClose:
			ok = false
		}
	}
	// Unblock the reader for the end; the caller checks the heap with
	// the connection still open.
	stalled.Store(false)
	select {
	case resume <- struct{}{}:
	default:
	}
	r.parseErr = func() error { <-r.reader; return parseErr }
	return r
}

// finish closes the client's connection, shuts the server down (or waits
// for the op's Shutdown) and then the apps, and fails on a frame of the
// server's that did not parse.
func (r *tlsRun) finish(t *testing.T) {
	t.Helper()
	_ = r.conn.Close()
	if err := r.parseErr(); err != nil {
		t.Errorf("server sent a frame that does not parse: %v", err)
	}
	if r.shutdown == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.srv.Shutdown(ctx); err != nil {
			t.Errorf("shutdown after the client closed: %v", err)
		}
	} else if err := <-r.shutdown; err != nil && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("shutdown: %v", err)
	}
	if err := <-r.served; err != nil {
		t.Errorf("serve: %v", err)
	}
	close(r.stopApps)
	r.apps.Wait()
}

// deliver connects a stream to the app its port names, over a pipe (no
// buffer: an app that does not read stalls the stream's next write).
func (r *tlsRun) deliver(_ context.Context, _ spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
	app := target.Port()
	switch app {
	case appStatus:
		return nil, &hbone.StatusError{Code: 502, Err: errors.New("not here")}
	case appRefused:
		return nil, errors.New("refused")
	}
	up, c := net.Pipe()
	r.apps.Add(1)
	go func() {
		defer r.apps.Done()
		defer c.Close()
		buf := make([]byte, 16<<10)
		switch app {
		case appEcho:
			_, _ = io.CopyBuffer(c, c, buf)
			return
		case appFlood:
			for {
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
		case appClose:
			return
		case appStall:
			if _, err := c.Read(buf); err != nil {
				return
			}
		}
		// Deaf (or stalled): reads nothing more until the input ends;
		// the server's writes wait until it closes the upstream.
		<-r.stopApps
	}()
	return up, nil
}

// frameOps writes the frames both TLS fuzzers' scripts share, each through
// write (one TLS write of what the framer call wrote); each returns false
// once a write failed. Stream bytes s name stream 2*(s&7)+1.
type frameOps struct {
	write func(func()) bool
	fr    *http2.Framer
}

func opStream(s byte) uint32 { return 2*uint32(s&7) + 1 }

// data: a[1]*64 bytes of DATA on stream a[0] in frames of up to 16 KiB,
// END_STREAM on the last if a[0]&0x80 (an empty frame when a[1] is 0).
func (o frameOps) data(a []byte) bool {
	p := make([]byte, int(a[1])*64)
	ok := true
	for len(p) > 0 && ok {
		n := min(len(p), 16<<10)
		end := a[0]&0x80 != 0 && n == len(p)
		ok = o.write(func() { _ = o.fr.WriteData(opStream(a[0]), end, p[:n]) })
		p = p[n:]
	}
	if a[1] == 0 && ok {
		ok = o.write(func() { _ = o.fr.WriteData(opStream(a[0]), a[0]&0x80 != 0, nil) })
	}
	return ok
}

// settings: one SETTINGS entry, id a[0], value a[1:5].
func (o frameOps) settings(a []byte) bool {
	return o.write(func() {
		_ = o.fr.WriteSettings(http2.Setting{ID: http2.SettingID(a[0]), Val: binary.BigEndian.Uint32(a[1:])})
	})
}

// window: WINDOW_UPDATE of a[1:5] on stream a[0], or on the connection if
// a[0]&0x80.
func (o frameOps) window(a []byte) bool {
	id := opStream(a[0])
	if a[0]&0x80 != 0 {
		id = 0
	}
	return o.write(func() { _ = o.fr.WriteWindowUpdate(id, binary.BigEndian.Uint32(a[1:])&(1<<31-1)) })
}

// reset: RST_STREAM on stream a, code a>>4.
func (o frameOps) reset(a byte) bool {
	return o.write(func() { _ = o.fr.WriteRSTStream(opStream(a), http2.ErrCode(a>>4)) })
}
