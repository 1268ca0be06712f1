package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

// maxHeaderBlock bounds the bytes of one header block on the wire (HEADERS
// and its CONTINUATION frames, with their frame headers): twice the header
// list allowed, plus room for the frames' own headers. x/net's Framer
// stops a block whose fragments carry too much, but not one of empty
// CONTINUATION frames, which add nothing to the list and would hold the
// read loop for as long as the peer sends them.
const maxHeaderBlock = 2*maxHeaderList + 16<<10

// errHeaderBlockTooLong ends a connection whose header block passed
// maxHeaderBlock.
var errHeaderBlockTooLong = errors.New("http/2 header block over 144 KiB (a CONTINUATION flood)")

// blockReader is the Framer's reader: while a header block is read it
// gives at most maxHeaderBlock bytes, then fails.
type blockReader struct {
	r    io.Reader
	left int
	on   bool
}

func (b *blockReader) start() { b.on, b.left = true, maxHeaderBlock }
func (b *blockReader) stop()  { b.on = false }

func (b *blockReader) Read(p []byte) (int, error) {
	if !b.on {
		return b.r.Read(p)
	}
	if b.left <= 0 {
		return 0, errHeaderBlockTooLong
	}
	n, err := b.r.Read(p[:min(len(p), b.left)])
	b.left -= n
	return n, err
}

// isTimeout reports whether err is a deadline's (a write the peer did not
// take in time).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// goAwayTimeout bounds the write of a GOAWAY that ends a connection on a
// protocol error (a peer that does not read does not hold the read loop).
const goAwayTimeout = time.Second

// h2Conn is one established HBONE connection served by the Server's HTTP/2
// engine: the CONNECT-only subset of RFC 9113 that HBONE uses (see
// README.md, "HTTP/2 implementation"). Its read loop reads every frame with
// an http2.Framer and writes each DATA payload straight to the stream's
// upstream socket (without waiting: what the socket cannot take now is
// queued on the stream and written by a goroutine of its own, bounded by the
// stream's receive window, which is granted back only for bytes the upstream
// took). Each stream's goroutine delivers it, then reads the upstream into a
// buffer with room for the frame header in front and sends DATA frames.
type h2Conn struct {
	s        *Server
	peer     spiffeid.ID // the client's verified SPIFFE ID
	h2Reader             // the Framer, header blocks bounded
	peerAddr netip.AddrPort
	ctx      context.Context // canceled when the connection closes
	cancel   context.CancelFunc
	done     chan struct{} // closed when the connection closes

	h2Out // frame writes and the control-frame queue

	// The read loop's batch of DATA for one stream (readFrame): payloads
	// batch[batchLo:batchDone] are complete and not written yet; one may
	// be being read into batch[batchDone:].
	batchSt            *h2Stream
	batch              []byte
	batchLo, batchDone int
	batchBuf           *[]byte

	// leave gives the connection's slot of the Budget back (nil: none
	// taken, tests); h2Out's h2Share holds the rest of its share.
	leave func()

	// unstarted are streams opened since the read loop last read its
	// socket: they are delivered (serve started) only once every frame
	// that came with their HEADERS was read, so a stream reset in the
	// same burst (a rapid reset) never dials its target (read loop only).
	unstarted []*h2Stream

	// The send side: windows, the client's settings, send buffers; its mu
	// guards the fields below too.
	h2Flow
	streams      map[uint32]*h2Stream
	maxID        uint32 // highest stream the client opened
	started      bool   // the client preface was read
	goingAway    bool   // GOAWAY queued: no new streams
	closeFlushed bool   // close once the queued control frames are written
	closed       bool
	idle         *time.Timer
}

// h2Transport is the connection under an h2Conn: an *hboneConn (TLS),
// or a plain connection in tests.
type h2Transport interface {
	io.ReadWriter
	// beginBatch and endBatch bracket Writes sent with one write(2).
	beginBatch()
	endBatch() error
	// setBeforeRead sets a function called, on the reading goroutine,
	// before every read of the underlying socket.
	setBeforeRead(func())
	SetReadDeadline(t time.Time) error
	SetWriteDeadline(t time.Time) error
	RemoteAddr() net.Addr
	Close() error
}

func newH2Conn(s *Server, conn h2Transport, peer spiffeid.ID) *h2Conn {
	ctx, cancel := context.WithCancel(context.Background())
	c := &h2Conn{
		s: s, peer: peer, ctx: ctx, cancel: cancel,
		done:    make(chan struct{}),
		streams: map[uint32]*h2Stream{},
	}
	if a, ok := conn.RemoteAddr().(*net.TCPAddr); ok {
		ap := a.AddrPort()
		c.peerAddr = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	window, slots := c.reserveShare(s.cfg.Budget, sourceKey(conn.RemoteAddr()), s.cfg.ConnWindow)
	c.initFlow(slots)
	c.initOut(conn, window, s.cfg.WriteTimeout, &s.stat.h2Counters, c.flood)
	conn.setBeforeRead(c.beforeRead)
	c.initReader(conn, s.cfg.MaxFrameSize)
	return c
}

// serve reads the client preface and then every frame until the connection
// ends; it returns when the connection is closed.
func (c *h2Conn) serve() {
	defer c.close(nil)
	cfg := &c.s.cfg
	// The preface is due within HandshakeTimeout; nothing is sent before
	// it (a client speaking anything else gets no answer).
	_ = c.conn.SetReadDeadline(time.Now().Add(cfg.HandshakeTimeout))
	var preface [len(clientPreface)]byte
	if _, err := io.ReadFull(c.conn, preface[:]); err != nil || string(preface[:]) != clientPreface {
		c.s.log.Debug("hbone connection without http/2 preface", "remote", c.conn.RemoteAddr().String(), "error", err)
		return
	}
	_ = c.conn.SetReadDeadline(time.Time{})
	c.mu.Lock()
	if c.goingAway || c.closed {
		c.mu.Unlock()
		return
	}
	c.started = true
	c.idle = time.AfterFunc(cfg.IdleTimeout, c.idleTimeout)
	c.mu.Unlock()
	c.startKeepalive(cfg.PingInterval, cfg.PingTimeout, func() {
		c.close(errors.New("failed to get a ping ack: timeout"))
	})

	settings := appendSettings(nil,
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: uint32(cfg.MaxConcurrentStreams)},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: uint32(min(cfg.StreamWindow, maxWindow))},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: uint32(cfg.MaxFrameSize)},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderList},
	)
	if c.window > 0 {
		settings = appendWindowUpdate(settings, 0, uint32(c.window))
	}
	if err := c.writePreface(settings, nil); err != nil { // ahead of a PING keepalive queued already
		return
	}
	c.s.wg.Add(1)
	go c.writeLoop()

	for first := true; ; first = false {
		f, err := c.readFrame(first)
		if f == nil && err == nil {
			continue // a DATA payload taken into the batch
		}
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.streamError(se.StreamID, se.Code)
				continue
			}
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				c.fail(http2.ErrCode(ce), fmt.Errorf("failed to read http/2 frame: %w", c.connErrorDetail(err)))
			}
			return
		}
		if _, ok := f.(*http2.SettingsFrame); first && !ok {
			c.fail(http2.ErrCodeProtocol, errors.New("first http/2 frame is not SETTINGS"))
			return
		}
		if p, ok := f.(*http2.PriorityFrame); ok && p.StreamDep == p.StreamID {
			// RFC 7540 §5.3.1: a stream cannot depend on itself.
			c.streamError(p.StreamID, http2.ErrCodeProtocol)
			continue
		}
		if err := handleFrame(c, c.queue, &c.keep, f); err != nil {
			var ce http2.ConnectionError
			code := http2.ErrCodeProtocol
			if errors.As(err, &ce) {
				code = http2.ErrCode(ce)
			}
			c.fail(code, err)
			return
		}
	}
}

// readFrame reads the next frame. A DATA payload for a stream whose
// upstream socket takes writes right away is read straight into the
// connection's batch (f and err nil): consecutive DATA of one stream go to
// the upstream with one write(2), made before the connection reads its
// socket again (the transport's beforeRead), when another frame comes, or
// when the batch is full. Any other frame is read by the Framer, after the
// batch is written.
func (c *h2Conn) readFrame(first bool) (http2.Frame, error) {
	fh, err := c.readHeader()
	if err != nil {
		c.flushBatch()
		return nil, err
	}
	if !first && c.takeData(fh) {
		return nil, c.readBatch(fh)
	}
	c.flushBatch()
	return c.readForHeader(fh)
}

// beforeRead runs before every read of the connection's socket (the
// transport's hook): the batch is written and the streams opened since
// the last read are delivered, unless they were reset meanwhile.
func (c *h2Conn) beforeRead() {
	c.flushBatch()
	c.startStreams()
}

// startStreams starts the delivery of the unstarted streams still open
// and forgets those reset before it (read loop only).
func (c *h2Conn) startStreams() {
	for i, st := range c.unstarted {
		c.unstarted[i] = nil
		if st.isStopped() {
			st.cancel()
			c.removeStream(st)
			continue
		}
		st.started = true
		c.s.wg.Add(1)
		go st.serve()
	}
	c.unstarted = c.unstarted[:0]
}

// batchMax bounds the DATA written to an upstream with one write(2).
const batchMax = 256 << 10

// takeData reports whether the DATA frame of fh goes into the batch: its
// stream is open, delivered to a socket with nothing queued, and the frame
// is within the windows and unpadded (anything else takes the Framer's
// path, which checks and answers it).
func (c *h2Conn) takeData(fh http2.FrameHeader) bool {
	if fh.Type != http2.FrameData || fh.StreamID == 0 || fh.Flags.Has(http2.FlagDataPadded) ||
		fh.Length == 0 || int64(fh.Length) > c.recvConn.left.Load() {
		return false
	}
	st := c.batchSt
	if st == nil || st.id != fh.StreamID {
		c.mu.Lock()
		st = c.streams[fh.StreamID]
		c.mu.Unlock()
		if st == nil {
			return false
		}
	}
	st.mu.Lock()
	ok := st.fastLocked() && !st.remoteEnd && st.consume(int64(fh.Length))
	st.mu.Unlock()
	if !ok {
		return false
	}
	c.recvConn.left.Add(-int64(fh.Length))
	if c.batchSt != st || len(c.batch)+int(fh.Length) > batchMax {
		c.flushBatch()
	}
	c.batchSt = st
	return true
}

// readBatch reads the payload of the DATA frame of fh into the batch.
func (c *h2Conn) readBatch(fh http2.FrameHeader) error {
	if c.batchBuf == nil {
		c.batchBuf = sockBufs.Get().(*[]byte)
		c.batch = (*c.batchBuf)[:0]
	}
	n := len(c.batch)
	c.batch = c.batch[:n+int(fh.Length)]
	// A read of the socket under this one writes what the batch holds
	// before it (beforeRead), but not this payload: it is not complete.
	if _, err := io.ReadFull(c.conn, c.batch[n:]); err != nil {
		return err
	}
	c.batchDone = len(c.batch)
	if fh.Flags.Has(http2.FlagDataEndStream) {
		st := c.batchSt
		c.flushBatch()
		st.onData(nil, 0, true)
	}
	return nil
}

// flushBatch writes the batch's complete DATA payloads to its stream's
// upstream (the read loop only: from readFrame and the transport's
// beforeRead). The buffer goes back to the pool unless a payload is being
// read into it.
func (c *h2Conn) flushBatch() {
	st := c.batchSt
	if st == nil {
		return
	}
	if c.batchDone > c.batchLo {
		st.mu.Lock()
		st.pushLocked(c.batch[c.batchLo:c.batchDone], int64(c.batchDone-c.batchLo), 0)
		c.batchLo = c.batchDone
	}
	if c.batchDone < len(c.batch) {
		return // a payload is being read into it
	}
	c.batchSt, c.batch, c.batchLo, c.batchDone = nil, nil, 0, 0
	if c.batchBuf != nil {
		sockBufs.Put(c.batchBuf)
		c.batchBuf = nil
	}
}

func (c *h2Conn) onRSTStream(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	st, idle := c.streams[f.StreamID], f.StreamID > c.maxID
	c.mu.Unlock()
	if idle {
		return connErrorf(http2.ErrCodeProtocol, "RST_STREAM on idle stream %d", f.StreamID)
	}
	if st != nil {
		c.stopStream(st)
	}
	return nil
}

// stopStream stops st (read loop only); one not started yet leaves the
// connection's streams at once, so a burst of rapid resets never counts
// against MaxConcurrentStreams.
func (c *h2Conn) stopStream(st *h2Stream) {
	st.stop()
	if !st.started {
		st.cancel()
		c.removeStream(st)
	}
}

func (c *h2Conn) onGoAway(*http2.GoAwayFrame) { c.goAway(http2.ErrCodeNo) }

// connError is a connection error (RFC 9113 §5.4.1) with its code; err,
// when set, is its cause.
type connError struct {
	code http2.ErrCode
	msg  string
	err  error
}

func (e *connError) Error() string {
	return "http/2 connection error " + e.code.String() + ": " + e.msg
}

func (e *connError) Unwrap() error { return e.err }

func (e *connError) As(target any) bool {
	if ce, ok := target.(*http2.ConnectionError); ok {
		*ce = http2.ConnectionError(e.code)
		return true
	}
	return false
}

func connErrorf(code http2.ErrCode, format string, args ...any) error {
	return &connError{code: code, msg: fmt.Sprintf(format, args...)}
}

func (c *h2Conn) onSettings(f *http2.SettingsFrame) error {
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingInitialWindowSize:
			c.mu.Lock()
			delta := int64(s.Val) - c.peerInitial
			c.peerInitial = int64(s.Val)
			for _, st := range c.streams {
				st.sendWin += delta
				if st.sendWin > maxWindow {
					c.mu.Unlock()
					return connErrorf(http2.ErrCodeFlowControl, "stream window above 2^31-1")
				}
			}
			c.cond.Broadcast()
			c.mu.Unlock()
		case http2.SettingMaxFrameSize:
			c.mu.Lock()
			c.peerMaxFrame = int(s.Val)
			c.mu.Unlock()
		}
		return nil
	})
	if err != nil {
		return err
	}
	c.queue(appendSettingsAck(nil))
	return nil
}

func (c *h2Conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	c.mu.Lock()
	if f.StreamID == 0 {
		c.sendConn += inc
		over := c.sendConn > maxWindow
		c.cond.Broadcast()
		c.mu.Unlock()
		if over {
			return connErrorf(http2.ErrCodeFlowControl, "connection window above 2^31-1")
		}
		return nil
	}
	if f.StreamID > c.maxID {
		c.mu.Unlock()
		return connErrorf(http2.ErrCodeProtocol, "WINDOW_UPDATE on idle stream %d", f.StreamID)
	}
	var over bool
	if st := c.streams[f.StreamID]; st != nil { // else closed: ignored
		st.sendWin += inc
		over = st.sendWin > maxWindow
		c.cond.Broadcast()
	}
	c.mu.Unlock()
	if over {
		c.streamError(f.StreamID, http2.ErrCodeFlowControl)
	}
	return nil
}

// onHeaders opens a stream (or ends one with trailers).
func (c *h2Conn) onHeaders(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	if id%2 == 0 {
		return connErrorf(http2.ErrCodeProtocol, "HEADERS on even stream %d", id)
	}
	cfg := &c.s.cfg
	c.mu.Lock()
	if st := c.streams[id]; st != nil {
		c.mu.Unlock()
		if !f.StreamEnded() {
			c.streamError(id, http2.ErrCodeProtocol) // trailers must end the stream
			return nil
		}
		st.onData(nil, 0, true)
		return nil
	}
	if id <= c.maxID {
		c.mu.Unlock()
		return connErrorf(http2.ErrCodeProtocol, "HEADERS on closed stream %d", id)
	}
	c.maxID = id
	refuse := c.goingAway || c.closed || len(c.streams) >= cfg.MaxConcurrentStreams
	c.mu.Unlock()
	if f.HasPriority() && f.Priority.StreamDep == id {
		// RFC 7540 §5.3.1: a stream cannot depend on itself.
		c.queue(appendRSTStream(nil, id, http2.ErrCodeProtocol))
		return nil
	}
	if refuse {
		c.queue(appendRSTStream(nil, id, http2.ErrCodeRefusedStream))
		return nil
	}
	ended := f.StreamEnded()
	method, authority := f.PseudoValue("method"), f.PseudoValue("authority")
	scheme, path := f.PseudoValue("scheme"), f.PseudoValue("path")
	switch {
	case f.Truncated:
		c.answer(id, http.StatusRequestHeaderFieldsTooLarge, ended)
		return nil
	case hasConnectionHeader(f):
		c.queue(appendRSTStream(nil, id, http2.ErrCodeProtocol))
		return nil
	case method == http.MethodConnect:
		// RFC 9113 §8.5: only :method and :authority.
		if scheme != "" || path != "" || authority == "" || f.PseudoValue("protocol") != "" {
			c.queue(appendRSTStream(nil, id, http2.ErrCodeProtocol))
			return nil
		}
	case method == "" || scheme == "" || path == "":
		c.queue(appendRSTStream(nil, id, http2.ErrCodeProtocol))
		return nil
	default:
		c.s.stat.streamsBadRequest.Add(1)
		c.answer(id, http.StatusMethodNotAllowed, ended)
		return nil
	}
	target, err := netip.ParseAddrPort(authority)
	if err != nil {
		c.s.stat.streamsBadRequest.Add(1)
		c.answer(id, http.StatusBadRequest, ended)
		return nil
	}
	if c.peer.IsZero() {
		// The peer's SPIFFE ID was verified and read once, at the handshake.
		c.s.stat.streamsBadRequest.Add(1)
		c.answer(id, http.StatusForbidden, ended)
		return nil
	}
	ctx := c.ctx
	if c.peerAddr.IsValid() {
		ctx = context.WithValue(ctx, peerAddrCtx{}, c.peerAddr)
	}
	st := &h2Stream{c: c, id: id, target: target, h2Recv: h2Recv{recvWin: int64(cfg.StreamWindow)}, remoteEnd: ended, state: stateOpen}
	if ended {
		st.state = stateHalfClosedRemote
	}
	st.flow, st.owner = &c.h2Flow, st
	st.ctx, st.cancel = context.WithCancel(ctx)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		st.cancel()
		return nil
	}
	st.sendWin = c.peerInitial
	c.streams[id] = st
	if len(c.streams) == 1 {
		c.idle.Stop()
	}
	c.mu.Unlock()
	c.unstarted = append(c.unstarted, st)
	return nil
}

// hasConnectionHeader reports whether f carries a connection-specific
// header field, which makes a request malformed (RFC 9113 §8.2.2):
// Connection, Proxy-Connection, Keep-Alive, Transfer-Encoding, Upgrade, or
// TE with a value other than "trailers". Names are lower case here: the
// Framer rejects any other as a stream error.
func hasConnectionHeader(f *http2.MetaHeadersFrame) bool {
	for _, hf := range f.RegularFields() {
		switch hf.Name {
		case "connection", "proxy-connection", "keep-alive", "transfer-encoding", "upgrade":
			return true
		case "te":
			if hf.Value != "trailers" {
				return true
			}
		}
	}
	return false
}

// answer ends a request the server does not deliver with status code.
func (c *h2Conn) answer(id uint32, code int, ended bool) {
	b := appendStatus(nil, id, code, true)
	if !ended {
		b = appendRSTStream(b, id, http2.ErrCodeNo)
	}
	c.queue(b)
}

// onDataFrame hands a DATA frame to its stream.
func (c *h2Conn) onDataFrame(f *http2.DataFrame) error {
	n := int64(f.Length) // with padding: what flow control counts
	if c.recvConn.left.Add(-n) < 0 {
		return connErrorf(http2.ErrCodeFlowControl, "DATA beyond the connection window")
	}
	c.mu.Lock()
	st, idle := c.streams[f.StreamID], f.StreamID > c.maxID
	c.mu.Unlock()
	if st == nil {
		if idle {
			return connErrorf(http2.ErrCodeProtocol, "DATA on idle stream %d", f.StreamID)
		}
		c.creditConn(n)
		c.queue(appendRSTStream(nil, f.StreamID, http2.ErrCodeStreamClosed))
		return nil
	}
	st.onData(f.Data(), n, f.StreamEnded())
	return nil
}

// streamError resets stream id with code (RST_STREAM) and stops it.
func (c *h2Conn) streamError(id uint32, code http2.ErrCode) {
	c.queue(appendRSTStream(nil, id, code))
	c.mu.Lock()
	st := c.streams[id]
	c.mu.Unlock()
	if st != nil {
		c.stopStream(st)
	}
}

// flood closes a connection whose client lets control frames pile up past
// a bound (h2Out.onFlood): its own maxQueuedControl or the node's budget.
func (c *h2Conn) flood(err error) {
	// Closed from another goroutine: queue may run under c.mu.
	c.s.log.Warn("closing hbone connection: its client does not read the control frames it asks for",
		"source_id", c.peer.String(), "remote", c.conn.RemoteAddr().String(), "error", err)
	go c.close(err)
}

// writeLoop writes queued control frames nobody else wrote; after a
// GOAWAY it closes the connection once they are written.
func (c *h2Conn) writeLoop() {
	defer c.s.wg.Done()
	c.close(c.writeControl(c.done, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.closeFlushed
	}))
}

// fail ends the connection on a connection error: GOAWAY with code, close.
func (c *h2Conn) fail(code http2.ErrCode, err error) {
	c.s.log.Debug("hbone http/2 connection error", "remote", c.conn.RemoteAddr().String(), "error", err)
	c.mu.Lock()
	last := c.maxID
	c.goingAway = true
	c.mu.Unlock()
	c.sendGoAway(last, code)
	c.close(err)
}

// goAway stops new streams (GOAWAY NO_ERROR) and closes the connection once
// its streams are done; before the preface it just closes.
func (c *h2Conn) goAway(code http2.ErrCode) {
	c.mu.Lock()
	if c.goingAway || c.closed {
		c.mu.Unlock()
		return
	}
	c.goingAway = true
	if !c.started {
		c.mu.Unlock()
		c.close(nil)
		return
	}
	last := c.maxID
	c.closeFlushed = len(c.streams) == 0
	c.mu.Unlock()
	c.queue(appendGoAway(nil, last, code))
}

func (c *h2Conn) idleTimeout() {
	c.mu.Lock()
	idle := len(c.streams) == 0
	c.mu.Unlock()
	if idle {
		c.goAway(http2.ErrCodeNo)
	}
}

// close ends the connection: every stream stops, its upstream is closed.
func (c *h2Conn) close(err error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	streams := make([]*h2Stream, 0, len(c.streams))
	for _, st := range c.streams {
		st.state = stateClosed
		streams = append(streams, st)
	}
	if c.idle != nil {
		c.idle.Stop()
	}
	c.keep.stop()
	c.cond.Broadcast()
	c.mu.Unlock()
	if err != nil {
		c.s.stat.countClose(err)
		c.s.log.Debug("hbone connection closed", "remote", c.conn.RemoteAddr().String(), "error", err)
	}
	close(c.done)
	c.cancel()
	c.shut()
	for _, st := range streams {
		st.closeIn()
	}
	if c.leave != nil {
		c.leave()
	}
	c.s.removeConn(c)
}

// removeStream forgets a finished stream; the connection's idle timer
// starts when it was the last, or the connection closes after a GOAWAY.
func (c *h2Conn) removeStream(st *h2Stream) {
	c.mu.Lock()
	if c.streams[st.id] == st {
		delete(c.streams, st.id)
	}
	var closing bool
	if len(c.streams) == 0 && !c.closed {
		if c.goingAway {
			c.closeFlushed, closing = true, true
		} else {
			c.idle.Reset(c.s.cfg.IdleTimeout)
		}
	}
	c.mu.Unlock()
	if closing {
		c.queue(nil)
	}
}
