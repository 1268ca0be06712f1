package hbone

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// plainConn runs the HTTP/2 engine over a TCP connection without TLS. It
// counts what the engine read, and where it was when it last came back
// for more (parked), so tests can wait until it processed what they sent.
type plainConn struct {
	*net.TCPConn
	beforeRead       func()
	consumed, parked atomic.Int64
}

func (*plainConn) beginBatch()              {}
func (*plainConn) endBatch() error          { return nil }
func (c *plainConn) setBeforeRead(f func()) { c.beforeRead = f }

func (c *plainConn) Read(p []byte) (int, error) {
	c.parked.Store(c.consumed.Load())
	c.beforeRead()
	n, err := c.TCPConn.Read(p)
	c.consumed.Add(int64(n))
	return n, err
}

// noCerts is a Certs that holds nothing: the engine never reads it.
type noCerts struct{}

func (noCerts) SVID(spiffeid.ID) (*x509svid.SVID, bool) { return nil, false }
func (noCerts) Bundle() *x509bundle.Bundle              { return nil }

var (
	fuzzTD     = spiffeid.RequireTrustDomainFromString("cluster.local")
	fuzzServer = spiffeid.RequireFromPath(fuzzTD, "/ns/dst/sa/server")
	fuzzClient = spiffeid.RequireFromPath(fuzzTD, "/ns/src/sa/client")
)

// Targets of the fuzzed server's Deliver, by :authority port.
const (
	portRefused = 1 // Deliver fails: 503
	portStatus  = 2 // Deliver fails with a StatusError: 502
	portPipe    = 4 // an echo behind net.Pipe: every DATA is queued
	portTCP     = 5 // an echo over loopback TCP: DATA is written straight
)

// frames builds HTTP/2 frames for the seed corpus.
type frames struct {
	bytes.Buffer
	fr   *http2.Framer
	hbuf bytes.Buffer
	henc *hpack.Encoder
}

func newFrames() *frames {
	f := &frames{}
	f.fr = http2.NewFramer(&f.Buffer, nil)
	f.fr.AllowIllegalWrites = true
	f.henc = hpack.NewEncoder(&f.hbuf)
	return f
}

func (f *frames) headers(id uint32, end bool, kv ...string) *frames {
	f.hbuf.Reset()
	for i := 0; i+1 < len(kv); i += 2 {
		_ = f.henc.WriteField(hpack.HeaderField{Name: kv[i], Value: kv[i+1]})
	}
	_ = f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: f.hbuf.Bytes(), EndStream: end, EndHeaders: true})
	return f
}

func (f *frames) connect(id uint32, port int, end bool) *frames {
	return f.headers(id, end, ":method", "CONNECT", ":authority", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)).String())
}

func (f *frames) settings(s ...http2.Setting) *frames { _ = f.fr.WriteSettings(s...); return f }
func (f *frames) data(id uint32, end bool, p string) *frames {
	_ = f.fr.WriteData(id, end, []byte(p))
	return f
}

// FuzzServerConn feeds arbitrary bytes after the client preface to the
// server's HTTP/2 engine: malformed frames, bad HPACK, frames in the wrong
// stream state. The engine must answer with frames a conforming HTTP/2
// parser accepts (GOAWAY or RST_STREAM for the errors, RFC 9113 §5.4), end
// the connection when the client does, and leave no goroutine behind; a
// panic fails, a hang never returns.
func FuzzServerConn(f *testing.F) {
	seeds := []*frames{
		newFrames().settings().connect(1, portTCP, false).data(1, true, "hello"),
		newFrames().settings().connect(1, portPipe, false).data(1, false, "hello").data(1, true, "again"),
		newFrames().settings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1}).connect(1, portTCP, false).data(1, true, "windowed"),
		newFrames().settings().connect(1, portRefused, true).connect(3, portStatus, false),
		newFrames().settings().headers(1, true, ":method", "GET", ":scheme", "https", ":path", "/", ":authority", "x"),
		newFrames().settings().headers(1, true, ":method", "CONNECT", ":authority", "example.com:80"),
		newFrames().settings().headers(1, true, ":method", "CONNECT", ":path", "/", ":authority", "127.0.0.1:5"),
		newFrames().settings().data(1, false, "idle"),
		newFrames().data(1, false, "no settings first"),
		newFrames().settings().connect(1, portTCP, false).connect(1, portTCP, false),
		newFrames().settings().connect(3, portTCP, false).connect(1, portTCP, false),
		newFrames().settings().connect(2, portTCP, false),
		newFrames().settings().connect(1, portPipe, true).data(1, false, "after end"),
	}
	// Each seed starts with the control byte (see below): split after
	// the first frames, plain reads; the first seeds also with 7-byte reads.
	add := func(b []byte) { f.Add(append([]byte{0x40}, b...)) }
	for _, s := range seeds {
		add(s.Bytes())
	}
	for _, s := range seeds[:3] {
		f.Add(append([]byte{0x41}, s.Bytes()...))
	}
	// Split after a delivered CONNECT: its DATA takes the batched path.
	for _, trickle := range []byte{0, 1} {
		open := newFrames().settings().connect(1, portTCP, false).connect(3, portPipe, false).Bytes()
		body := newFrames().data(1, false, "batched").data(1, false, "twice").data(3, false, "queued").data(1, true, "the end of the stream").Bytes()
		in := append(append([]byte{0}, open...), body...)
		for c := int(trickle); c < 256; c += 2 {
			if c*(len(in)-1)/256 >= len(open) {
				in[0] = byte(c)
				break
			}
		}
		f.Add(in)
	}
	{
		s := newFrames().settings().connect(1, portTCP, false)
		_ = s.fr.WriteRSTStream(1, http2.ErrCodeCancel)
		s.data(1, false, "after reset")
		_ = s.fr.WriteWindowUpdate(0, 0)
		add(s.Bytes())
		s = newFrames().settings()
		_ = s.fr.WritePing(false, [8]byte{1})
		_ = s.fr.WriteGoAway(0, http2.ErrCodeNo, nil)
		_ = s.fr.WriteWindowUpdate(0, 1<<31-1)
		_ = s.fr.WriteWindowUpdate(0, 1<<31-1)
		add(s.Bytes())
		s = newFrames().settings()
		_ = s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0xff, 0xff, 0xff, 0x7f}, EndHeaders: true})
		add(s.Bytes())
		s = newFrames().settings()
		_ = s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x82}})
		_ = s.fr.WriteContinuation(3, true, []byte{0x84})
		add(s.Bytes())
		s = newFrames().settings().connect(1, portTCP, false)
		_ = s.fr.WriteDataPadded(1, false, []byte("padded"), make([]byte, 20))
		_ = s.fr.WritePriority(1, http2.PriorityParam{StreamDep: 1})
		_ = s.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, EndHeaders: true})
		add(s.Bytes())
	}

	echo := echoServer(f)
	srv, err := NewServer(ServerConfig{
		Identity: fuzzServer, Certs: noCerts{},
		StreamWindow: 1 << 16, ConnWindow: 1 << 17, MaxConcurrentStreams: 4,
		Deliver: func(ctx context.Context, _ spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			switch target.Port() {
			case portRefused:
				return nil, errors.New("refused")
			case portStatus:
				return nil, &StatusError{Code: 502, Err: errors.New("not here")}
			case portTCP:
				var d net.Dialer
				return d.DialContext(ctx, "tcp", echo.String())
			}
			up, app := net.Pipe()
			go func() {
				_, _ = io.Copy(app, app)
				_ = app.Close()
			}()
			return up, nil
		},
	})
	if err != nil {
		f.Fatal(err)
	}
	ln := loopbackListener(f)
	f.Fuzz(func(t *testing.T, in []byte) {
		// The first byte picks the transport (odd: reads of at most 7
		// bytes, so payloads span reads) and where the input is split:
		// the second part is sent once the streams the first opened are
		// delivered, so that their DATA takes the batched path.
		var split int
		trickle := false
		if len(in) > 0 {
			trickle = in[0]&1 == 1
			split = 1 + int(in[0])*(len(in)-1)/256
		}
		cli, c, pc, served := serveConn(t, srv, ln, trickle)
		defer cli.Close()
		// Everything the server sends must parse as HTTP/2 frames.
		parsed := make(chan error, 1)
		go func() {
			fr := http2.NewFramer(nil, cli)
			fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
			for {
				if _, err := fr.ReadFrame(); err != nil {
					var ne *net.OpError
					if errors.Is(err, io.EOF) || errors.As(err, &ne) {
						// The end, or a reset: the server closed with
						// input unread.
						err = nil
					}
					parsed <- err
					return
				}
			}
		}()
		_, _ = cli.Write([]byte(clientPreface))
		if split > 0 {
			_, _ = cli.Write(in[1:split])
			waitDelivered(c, pc, int64(len(clientPreface)+split-1), served)
			in = in[split:]
		}
		_, _ = cli.Write(in)
		_ = cli.CloseWrite()
		<-served
		if err := <-parsed; err != nil {
			t.Fatalf("server sent a frame that does not parse: %v", err)
		}
		srv.wg.Wait()
		srv.mu.Lock()
		n := len(srv.conns)
		srv.mu.Unlock()
		if n != 0 {
			t.Fatalf("%d connections still tracked after the connection ended", n)
		}
	})
}

// loopbackListener listens on loopback TCP until the test ends.
func loopbackListener(tb testing.TB) *net.TCPListener {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = ln.Close() })
	return ln
}

// serveConn connects to ln and serves the accepted end with srv's engine
// over a plainConn (trickle: a trickleConn); served is closed when serve
// returns.
func serveConn(t *testing.T, srv *Server, ln *net.TCPListener, trickle bool) (cli *net.TCPConn, c *h2Conn, pc *plainConn, served chan struct{}) {
	t.Helper()
	cli, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	sc, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	tc := &trickleConn{plainConn: plainConn{TCPConn: sc}}
	pc = &tc.plainConn
	var conn h2Transport = pc
	if trickle {
		conn = tc
	}
	c = newH2Conn(srv, conn, fuzzClient)
	if !srv.untrack(nil, c) {
		t.Fatal("server closed")
	}
	served = make(chan struct{})
	srv.wg.Add(1)
	go func() {
		defer srv.wg.Done()
		defer close(served)
		c.serve()
	}()
	return cli, c, pc, served
}

// waitDelivered returns once c read the first total bytes and came back
// for more, and every open stream of c has its upstream (or is closed);
// or once c is done.
func waitDelivered(c *h2Conn, pc *plainConn, total int64, done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		default:
		}
		waiting := pc.parked.Load() < total
		c.mu.Lock()
		for _, st := range c.streams {
			st.mu.Lock()
			waiting = waiting || st.up == nil && !st.closedIn
			st.mu.Unlock()
		}
		c.mu.Unlock()
		if !waiting {
			return
		}
		runtime.Gosched()
	}
}

// echoServer echoes every loopback TCP connection until EOF.
func echoServer(tb testing.TB) netip.AddrPort {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(c, c)
				_ = c.Close()
			}()
		}
	}()
	tb.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
	return ln.Addr().(*net.TCPAddr).AddrPort()
}
