package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"sync"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

// Errors a stream fails with. errGoAway (the stream is above a GOAWAY's
// last stream ID), errRefused (REFUSED_STREAM) and errNotSent (the
// connection could take no stream before its HEADERS went out, or the
// write they ended failed) say the server did not process it: Dial
// retries those, and only those, once on a new connection (retryable).
var (
	errGoAway       = errors.New("hbone stream not processed: the server sent GOAWAY")
	errRefused      = errors.New("hbone stream refused by the server")
	errNotSent      = errors.New("hbone stream not sent")
	errConnClosed   = errors.New("hbone connection closed")
	errStreamClosed = errors.New("hbone stream closed")
)

// retryable reports whether a stream failed before the server processed
// it (RFC 9113 §8.7: a stream above GOAWAY's last stream ID or refused with
// REFUSED_STREAM; or never sent): retrying it cannot deliver the CONNECT
// twice. Anything else (a reset with another code, a connection that broke
// after the HEADERS were written, a status) may have reached the target.
func retryable(err error) bool {
	return errors.Is(err, errGoAway) || errors.Is(err, errRefused) || errors.Is(err, errNotSent)
}

// maxStreamID is the highest client stream ID (2^31-1); a connection that
// used them all takes no new streams.
const maxStreamID = 1<<31 - 1

// h2Client is one pooled HBONE connection of the Dialer, on the Dialer's
// own HTTP/2 client engine: the CONNECT-only subset of RFC 9113 that HBONE
// uses (see README.md, "HTTP/2 implementation"). Its read loop reads every
// frame; a DATA payload is read from the TLS connection straight into the
// buffer of the stream's waiting Read, or else into the stream's queue,
// bounded by the receive window, which is granted back only for bytes Read
// took. Stream.Write sends DATA frames from the writing goroutine, under
// the connection's write lock, within the server's flow-control windows.
type h2Client struct {
	h2Out // frame writes and the control-frame queue

	cfg  *DialerConfig
	log  *slog.Logger
	peer spiffeid.ID // the server's verified SPIFFE ID
	h2Reader
	wg   *sync.WaitGroup // the Dialer's: read and write loops
	stat *dialerCounters // the Dialer's
	done chan struct{}   // closed when the connection closes
	// ready is closed when the server's first SETTINGS was applied (or
	// the connection failed before).
	ready chan struct{}

	// The send side: windows, the server's settings, send buffers; its mu
	// guards the fields below too.
	h2Flow
	streams    map[uint32]*Stream
	nextID     uint32 // the next stream's ID
	reserved   int    // slots the Dialer reserved, streams not opened yet
	maxStreams int    // the server's SETTINGS_MAX_CONCURRENT_STREAMS
	settled    bool   // the server's first SETTINGS arrived
	goingAway  bool   // GOAWAY received, or evicted: no new streams
	closed     bool
	err        error // why the connection closed
}

func newH2Client(cfg *DialerConfig, log *slog.Logger, wg *sync.WaitGroup, stat *dialerCounters, conn h2Transport, peer spiffeid.ID, origin string) *h2Client {
	c := &h2Client{
		cfg: cfg, log: log, peer: peer, wg: wg, stat: stat,
		done:       make(chan struct{}),
		ready:      make(chan struct{}),
		streams:    map[uint32]*Stream{},
		nextID:     1,
		maxStreams: DefaultMaxConcurrentStreams,
	}
	budget := cfg.Budget
	if budget == nil {
		budget = defaultBudget()
	}
	// The share is kept under the Request's Origin (the source pod).
	window, slots := c.reserveShare(budget, origin, cfg.ConnWindow)
	c.initFlow(slots)
	c.initOut(conn, window, cfg.WriteTimeout, &stat.h2Counters, c.flood)
	c.initReader(conn, cfg.MaxFrameSize)
	return c
}

// start sends the client preface and our SETTINGS, starts the read and
// write loops (the caller added 2 to wg for them) and waits for the
// server's SETTINGS (its stream limit and windows apply to the first
// stream already) until ctx ends.
func (c *h2Client) start(ctx context.Context) error {
	b := append([]byte(clientPreface), appendSettings(nil,
		http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: uint32(c.cfg.StreamWindow)},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: uint32(c.cfg.MaxFrameSize)},
		http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderList},
	)...)
	if w := c.recvConn.size; w > initialWindow {
		b = appendWindowUpdate(b, 0, uint32(w-initialWindow))
	}
	// The loops start first (they end when the connection closes, also
	// when this write fails), under the write lock: the preface is on the
	// wire before any frame they queue (the ack of the server's SETTINGS).
	if err := c.writePreface(b, func() {
		go c.readLoop()
		go c.writeLoop()
	}); err != nil {
		c.close(err)
		return fmt.Errorf("failed to send the http/2 preface: %w", err)
	}
	c.startKeepalive(c.cfg.PingInterval, c.cfg.PingTimeout, func() {
		c.close(fmt.Errorf("%w: no ping ack within %s", errConnClosed, c.cfg.PingTimeout))
	})
	select {
	case <-c.ready:
	case <-ctx.Done():
		c.close(ctx.Err())
		return fmt.Errorf("failed to get the server's http/2 settings: %w", ctx.Err())
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("failed to get the server's http/2 settings: %w", c.err)
	}
	return nil
}

// unusable reports whether the connection takes no new streams (closed,
// GOAWAY, evicted).
func (c *h2Client) unusable() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed || c.goingAway
}

// broken reports whether the connection closed.
func (c *h2Client) broken() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// reserve takes a stream slot when the server's limit leaves one.
func (c *h2Client) reserve() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.goingAway || len(c.streams)+c.reserved >= c.maxStreams || c.nextID+2*uint32(c.reserved) > maxStreamID {
		return false
	}
	c.reserved++
	return true
}

// drain takes no new streams and closes the connection once its streams
// are done (the pool evicted it while it still worked).
func (c *h2Client) drain() {
	c.mu.Lock()
	c.goingAway = true
	c.mu.Unlock()
	c.closeIfDone()
}

// closeIfDone closes a connection that takes no new streams once it has
// none left (nor slots reserved for them).
func (c *h2Client) closeIfDone() {
	c.mu.Lock()
	done := c.goingAway && !c.closed && len(c.streams) == 0 && c.reserved == 0
	c.mu.Unlock()
	if done {
		c.close(errConnClosed)
	}
}

// openStream sends CONNECT for target on a reserved slot and waits for
// the answer until ctx ends.
func (c *h2Client) openStream(ctx context.Context, target netip.AddrPort) (*Stream, error) {
	st := &Stream{c: c, target: target, peer: c.peer, answered: make(chan struct{}), h2Recv: h2Recv{recvWin: int64(c.cfg.StreamWindow)}}
	st.cond.L = &st.mu
	st.flow, st.owner = &c.h2Flow, st
	hdr := appendConnect(nil, target.String())
	c.wmu.Lock()
	c.mu.Lock()
	c.reserved--
	if c.closed || c.goingAway || c.nextID > maxStreamID {
		err := errNotSent
		if c.err != nil {
			err = fmt.Errorf("%w: %w", errNotSent, c.err)
		}
		c.mu.Unlock()
		c.wmu.Unlock()
		c.closeIfDone()
		return nil, err
	}
	st.id, st.state = c.nextID, stateOpen
	c.nextID += 2
	st.sendWin = c.peerInitial
	c.streams[st.id] = st
	c.mu.Unlock()
	putFrameHeader(hdr, len(hdr)-frameHeaderLen, http2.FrameHeaders, http2.FlagHeadersEndHeaders, st.id)
	err := c.writeFramesLocked(hdr)
	c.wmu.Unlock()
	if err != nil {
		// The HEADERS end the write that failed, so they did not reach
		// the server whole: it cannot have processed the stream.
		st.fail(fmt.Errorf("%w: %w", errNotSent, err))
		c.close(err)
	}
	select {
	case <-st.answered:
	case <-ctx.Done():
		st.reset(http2.ErrCodeCancel, ctx.Err())
		<-st.answered
	}
	st.mu.Lock()
	err = st.dialErr
	st.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return st, nil
}

// appendConnect returns the HEADERS frame of a CONNECT request, with room
// for its frame header in front: `:method: CONNECT` and `:authority`, as
// HPACK literals without indexing (static names), so the header block
// carries no encoder state.
func appendConnect(b []byte, authority string) []byte {
	b = append(b, make([]byte, frameHeaderLen)...)
	b = append(b, 0x02) // literal without indexing, name = static entry 2 (:method)
	b = appendHPACKString(b, http.MethodConnect)
	b = append(b, 0x01) // name = static entry 1 (:authority)
	return appendHPACKString(b, authority)
}

// appendHPACKString appends s as an HPACK string literal (RFC 7541 §5.2,
// no Huffman coding).
func appendHPACKString(b []byte, s string) []byte {
	n := len(s)
	if n < 127 {
		b = append(b, byte(n))
	} else {
		b = append(b, 127)
		n -= 127
		for n >= 128 {
			b = append(b, byte(n%128+128))
			n /= 128
		}
		b = append(b, byte(n))
	}
	return append(b, s...)
}

// readLoop reads frames until the connection ends, then closes it.
func (c *h2Client) readLoop() {
	defer c.wg.Done()
	err := c.readFrames()
	var ce http2.ConnectionError
	if errors.As(err, &ce) {
		c.fail(http2.ErrCode(ce), c.connErrorDetail(err))
		return
	}
	if errors.Is(err, io.EOF) {
		err = fmt.Errorf("%w by the server: %w", errConnClosed, io.ErrUnexpectedEOF)
	}
	c.close(err)
}

func (c *h2Client) readFrames() error {
	for first := true; ; first = false {
		fh, err := c.readHeader()
		if err != nil {
			return err
		}
		if first && fh.Type != http2.FrameSettings {
			return connErrorf(http2.ErrCodeProtocol, "first http/2 frame from the server is not SETTINGS")
		}
		if fh.Type == http2.FrameData && fh.StreamID != 0 && !fh.Flags.Has(http2.FlagDataPadded) {
			if err := c.onData(fh, nil); err != nil {
				return err
			}
			continue
		}
		f, err := c.readForHeader(fh)
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.streamError(se.StreamID, se.Code, fmt.Errorf("failed to read http/2 frame: %w", err))
				continue
			}
			return err
		}
		if err := handleFrame(c, c.queue, &c.keep, f); err != nil {
			return err
		}
	}
}

// onDataFrame takes a padded DATA frame (the Framer read it).
func (c *h2Client) onDataFrame(f *http2.DataFrame) error { return c.onData(f.FrameHeader, f) }

func (c *h2Client) onRSTStream(f *http2.RSTStreamFrame) error {
	st, err := c.stream(f.StreamID, "RST_STREAM")
	if st != nil {
		st.onReset(f.ErrCode)
	}
	return err
}

// stream returns the open stream id; nil when it is closed (an error when
// it was never opened: a connection error).
func (c *h2Client) stream(id uint32, what string) (*Stream, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if id%2 == 0 || id >= c.nextID {
		return nil, connErrorf(http2.ErrCodeProtocol, "%s on idle stream %d", what, id)
	}
	return c.streams[id], nil
}

func (c *h2Client) onSettings(f *http2.SettingsFrame) error {
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		switch s.ID {
		case http2.SettingMaxConcurrentStreams:
			c.maxStreams = int(min(s.Val, 1<<20))
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.peerInitial
			c.peerInitial = int64(s.Val)
			for _, st := range c.streams {
				st.sendWin += delta
				if st.sendWin > maxWindow {
					return connErrorf(http2.ErrCodeFlowControl, "stream window above 2^31-1")
				}
			}
			c.cond.Broadcast()
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = int(s.Val)
		}
		return nil
	})
	if err != nil {
		return err
	}
	c.queue(appendSettingsAck(nil))
	c.mu.Lock()
	first := !c.settled
	c.settled = true
	c.mu.Unlock()
	if first {
		close(c.ready)
	}
	return nil
}

func (c *h2Client) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	var st *Stream
	if f.StreamID != 0 {
		var err error
		if st, err = c.stream(f.StreamID, "WINDOW_UPDATE"); st == nil {
			return err // closed (nil: ignored) or idle
		}
	}
	c.mu.Lock()
	win := &c.sendConn
	if st != nil {
		win = &st.sendWin
	}
	*win += int64(f.Increment)
	over := *win > maxWindow
	c.cond.Broadcast()
	c.mu.Unlock()
	switch {
	case over && st == nil:
		return connErrorf(http2.ErrCodeFlowControl, "connection window above 2^31-1")
	case over:
		c.streamError(f.StreamID, http2.ErrCodeFlowControl, errors.New("server grew the stream window above 2^31-1"))
	}
	return nil
}

// onHeaders takes the answer to a CONNECT, or trailers that end a stream.
func (c *h2Client) onHeaders(f *http2.MetaHeadersFrame) error {
	st, err := c.stream(f.StreamID, "HEADERS")
	if st == nil {
		return err
	}
	st.mu.Lock()
	answered := st.dialErr != nil || st.open
	st.mu.Unlock()
	if answered {
		if !f.StreamEnded() {
			c.streamError(st.id, http2.ErrCodeProtocol, errors.New("server sent trailers without END_STREAM"))
			return nil
		}
		st.onEnd()
		return nil
	}
	if f.Truncated {
		c.streamError(st.id, http2.ErrCodeProtocol, errors.New("response header list too large"))
		return nil
	}
	code, err := strconv.Atoi(f.PseudoValue("status"))
	switch {
	case err != nil || code < 100 || code > 999:
		c.streamError(st.id, http2.ErrCodeProtocol, fmt.Errorf("bad :status %q", f.PseudoValue("status")))
	case code < 200 && !f.StreamEnded():
		// 1xx: the final answer follows.
	case code == http.StatusOK:
		st.onAnswer(nil, f.StreamEnded())
	default:
		st.onAnswer(&StatusError{Code: code, Err: errors.New(strconv.Itoa(code) + " " + http.StatusText(code))}, true)
		if !f.StreamEnded() {
			c.queue(appendRSTStream(nil, st.id, http2.ErrCodeCancel))
		}
		c.removeStream(st)
	}
	return nil
}

// onData takes a DATA frame: its payload (unpadded: f nil, still to be read
// from the connection; padded: in f) goes to its stream.
func (c *h2Client) onData(fh http2.FrameHeader, f *http2.DataFrame) error {
	n := int64(fh.Length)
	if c.recvConn.left.Add(-n) < 0 {
		return connErrorf(http2.ErrCodeFlowControl, "DATA beyond the connection window")
	}
	st, err := c.stream(fh.StreamID, "DATA")
	if err != nil {
		return err
	}
	var data []byte
	if f != nil {
		data = f.Data()
		c.creditConn(n - int64(len(data))) // padding
		n = int64(len(data))
	}
	if st == nil {
		// A stream we closed: its DATA is dropped.
		c.creditConn(n)
		if f == nil {
			return c.discard(n)
		}
		return nil
	}
	return st.onData(fh, n, data)
}

// discard reads and drops n payload bytes.
func (c *h2Client) discard(n int64) error {
	_, err := io.CopyN(io.Discard, c.conn, n)
	return err
}

// onGoAway stops new streams; streams above its last stream ID were not
// processed and fail (Dial retries them on a new connection).
func (c *h2Client) onGoAway(f *http2.GoAwayFrame) {
	last, code := f.LastStreamID, f.ErrCode
	c.mu.Lock()
	c.goingAway = true
	var gone []*Stream
	for id, st := range c.streams {
		if id > last {
			gone = append(gone, st)
		}
	}
	c.mu.Unlock()
	c.log.Debug("hbone connection got GOAWAY", "remote", c.conn.RemoteAddr().String(), "code", code.String())
	for _, st := range gone {
		st.fail(errGoAway)
		c.removeStream(st)
	}
	c.closeIfDone()
}

// streamError resets stream id with code and fails it with err.
func (c *h2Client) streamError(id uint32, code http2.ErrCode, err error) {
	c.mu.Lock()
	st := c.streams[id]
	c.mu.Unlock()
	if st != nil {
		st.reset(code, fmt.Errorf("hbone stream error %s: %w", code, err))
		return
	}
	c.queue(appendRSTStream(nil, id, code))
}

// flood closes a connection whose server lets control frames pile up past
// a bound (h2Out.onFlood): its own maxQueuedControl or the budget's.
func (c *h2Client) flood(err error) {
	c.log.Warn("closing hbone connection: its server does not read the control frames it asks for",
		"remote", c.conn.RemoteAddr().String(), "error", err)
	// Closed from another goroutine: queue may run under a stream's lock.
	go c.close(err)
}

// writeLoop writes queued control frames nobody else wrote.
func (c *h2Client) writeLoop() {
	defer c.wg.Done()
	c.close(c.writeControl(c.done, nil))
}

// fail ends the connection on a connection error: GOAWAY with code, close.
func (c *h2Client) fail(code http2.ErrCode, err error) {
	c.sendGoAway(0, code)
	c.close(err)
}

// close ends the connection: every stream not ended by the server fails
// with err.
func (c *h2Client) close(err error) {
	if err == nil {
		err = errConnClosed
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	c.err = err
	streams := make([]*Stream, 0, len(c.streams))
	for _, st := range c.streams {
		streams = append(streams, st)
	}
	clear(c.streams)
	c.keep.stop()
	settled := c.settled
	c.settled = true
	c.cond.Broadcast()
	c.mu.Unlock()
	if !settled {
		close(c.ready)
	}
	c.stat.countClose(err)
	c.log.Debug("hbone connection closed", "remote", c.conn.RemoteAddr().String(), "error", err)
	close(c.done)
	c.shut()
	for _, st := range streams {
		st.fail(fmt.Errorf("%w: %w", errConnClosed, err))
	}
}

// removeStream forgets a finished stream (its slot is free); after GOAWAY
// the connection closes with its last stream.
func (c *h2Client) removeStream(st *Stream) {
	c.mu.Lock()
	if c.streams[st.id] == st {
		delete(c.streams, st.id)
	}
	c.cond.Broadcast()
	c.mu.Unlock()
	c.closeIfDone()
}
