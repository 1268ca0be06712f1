package hbone

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// The HTTP/2 core both engines share (the Server's h2Conn and the Dialer's
// h2Client; h2out.go holds the write side, the frame dispatch and the
// keepalive, h2frame.go the encoders): a connection's send window and the
// peer's settings that bound what is sent (h2Flow); each stream's send
// window and the send buffers it holds (h2Send, the sendGate a copy into
// the stream reads through), its receive window (h2Recv) and its state
// (streamState); the connection's share of its Budget (h2Share); the
// Framer with the header-block and frame-size caps (h2Reader); and the
// per-reason counters of the connections closed (h2Counters). See
// README.md, "The shared core".

// maxSendBufs is how many streams of a connection may hold a send buffer
// (sockBuf each: an upstream or source socket's read, or a Write's frames)
// at once: the rest wait for one without a buffer, so a peer that reads
// slowly holds at most 1 MiB of ours per connection while its writes are
// waited for (up to WriteTimeout). The Budget's send-buffer tokens bound
// them per source and per node as well.
const maxSendBufs = 4

// h2Flow is a connection's send-side state, under mu (the engine's
// connection lock, which also guards its streams).
type h2Flow struct {
	mu           sync.Mutex
	cond         sync.Cond // send windows grew, a send buffer came back, a stream stopped, or the connection closed
	sendConn     int64     // connection send window
	peerInitial  int64     // the peer's SETTINGS_INITIAL_WINDOW_SIZE
	peerMaxFrame int       // the peer's SETTINGS_MAX_FRAME_SIZE
	sendBufs     int       // streams holding a send buffer (sendGate)
	// slots are the send-buffer tokens of the node and of the
	// connection's source (the Budget's), taken with each send buffer.
	slots sendSlots
}

// initFlow sets HTTP/2's initial windows and frame size and the tokens.
func (f *h2Flow) initFlow(slots sendSlots) {
	f.cond.L = &f.mu
	f.sendConn, f.peerInitial, f.peerMaxFrame = initialWindow, initialWindow, DefaultMaxFrameSize
	f.slots = slots
}

// sendOwner is the stream an h2Send belongs to.
type sendOwner interface {
	// sendErrLocked is why the stream can send no more (flow.mu held);
	// nil while it can.
	sendErrLocked() error
	// sendStop returns a channel closed once sendErrLocked is not nil
	// (flow.mu held).
	sendStop() <-chan struct{}
}

// h2Send is one stream's send side: its send window and the send-buffer
// tokens wait took for take. It is the stream's sendGate.
type h2Send struct {
	flow  *h2Flow
	owner sendOwner
	// Under flow.mu.
	sendWin int64
	held    int // token pairs wait acquired that no take used yet
}

// readyLocked reports whether both windows are open and a send buffer of
// the connection is free (flow.mu held).
func (s *h2Send) readyLocked() bool {
	f := s.flow
	return s.sendWin > 0 && f.sendConn > 0 && f.sendBufs < maxSendBufs
}

// wait blocks, holding no buffer, until the peer's windows are open and a
// send buffer of the connection is free, then takes (waiting in turn) the
// tokens of a send buffer of its source and of the node, for the take that
// follows (sendGate). It fails with the owner's sendErrLocked.
func (s *h2Send) wait() error {
	f := s.flow
	f.mu.Lock()
	for {
		if err := s.owner.sendErrLocked(); err != nil {
			f.mu.Unlock()
			s.dropHeld()
			return err
		}
		if s.readyLocked() {
			break
		}
		f.cond.Wait()
	}
	if s.held > 0 {
		f.mu.Unlock()
		return nil
	}
	stop := s.owner.sendStop()
	f.mu.Unlock()
	if !f.slots.acquire(stop) {
		f.mu.Lock()
		err := s.owner.sendErrLocked()
		f.mu.Unlock()
		if err == nil {
			err = errStreamStopped
		}
		return err
	}
	f.mu.Lock()
	s.held++
	f.mu.Unlock()
	return nil
}

// take reserves up to limit bytes of the peer's windows and a send buffer
// (sendGate), with the tokens wait took or, without them, tokens free now;
// 0 when there is none now (the tokens held go back: a stream that cannot
// send does not hold them).
func (s *h2Send) take(limit int) int {
	m, _ := s.takeFit(limit, nil)
	return m
}

// takeFit is take with the amount also bounded by fit(the peer's frame
// size) when fit is set; it returns the amount and that frame size.
func (s *h2Send) takeFit(limit int, fit func(maxFrame int) int) (int, int) {
	f := s.flow
	f.mu.Lock()
	ok := s.owner.sendErrLocked() == nil && s.readyLocked()
	switch {
	case ok && s.held > 0:
		s.held--
	case ok:
		ok = f.slots.tryTake()
	}
	if !ok {
		f.mu.Unlock()
		s.dropHeld()
		return 0, 0
	}
	m := int(min(int64(limit), s.sendWin, f.sendConn))
	if fit != nil {
		m = min(m, fit(f.peerMaxFrame))
	}
	s.sendWin -= int64(m)
	f.sendConn -= int64(m)
	f.sendBufs++
	maxFrame := f.peerMaxFrame
	f.mu.Unlock()
	return m, maxFrame
}

// back returns n bytes of window take reserved and not sent, and the send
// buffer with its tokens (sendGate).
func (s *h2Send) back(n int) {
	f := s.flow
	f.mu.Lock()
	s.sendWin += int64(n)
	f.sendConn += int64(n)
	f.sendBufs--
	f.cond.Broadcast()
	f.mu.Unlock()
	f.slots.give()
}

// dropHeld gives back the tokens wait took and no take used.
func (s *h2Send) dropHeld() {
	f := s.flow
	f.mu.Lock()
	k := s.held
	s.held = 0
	f.mu.Unlock()
	for range k {
		f.slots.give()
	}
}

// h2Share is what one connection holds of its Budget, under its source's
// key: the receive window beyond HTTP/2's initial 64 KiB, the send-buffer
// tokens (h2Flow.slots), and the control bytes h2Out charges.
type h2Share struct {
	budget *Budget
	src    string // the Budget's key: the client's address, the Dialer's Origin
	window int64  // receive window reserved beyond initialWindow
}

// reserveShare takes the connection's share of budget for src: up to
// connWindow of receive window in all (the initial 64 KiB needs no
// grant; what the budget has left, possibly nothing, beyond it) and the
// source's send-buffer tokens. It returns the window and the tokens.
func (h *h2Share) reserveShare(budget *Budget, src string, connWindow int) (int, sendSlots) {
	h.budget, h.src = budget, src
	h.window = budget.reserveWindow(src, int64(connWindow-initialWindow))
	return initialWindow + int(h.window), budget.slots(src)
}

// releaseShare gives the window and the tokens back (the connection closed).
func (h *h2Share) releaseShare() {
	h.budget.releaseWindow(h.src, h.window)
	h.budget.dropSlots(h.src)
}

// h2Reader is the read side both engines share: a Framer (frames reused,
// HEADERS and CONTINUATION merged and HPACK-decoded, the header list
// bounded by maxHeaderList) over a blockReader that bounds a header block
// on the wire by maxHeaderBlock.
type h2Reader struct {
	fr    *http2.Framer
	block blockReader // the Framer's reader
}

// initReader reads conn with frames of at most maxFrame bytes.
func (r *h2Reader) initReader(conn io.Reader, maxFrame int) {
	r.block.r = conn
	r.fr = http2.NewFramer(nil, &r.block)
	r.fr.SetReuseFrames()
	r.fr.SetMaxReadFrameSize(uint32(maxFrame))
	r.fr.MaxHeaderListSize = maxHeaderList
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
}

// readHeader reads the next frame header; a frame over the size we
// advertised is a connection error (FRAME_SIZE_ERROR).
func (r *h2Reader) readHeader() (http2.FrameHeader, error) {
	fh, err := r.fr.ReadFrameHeader()
	if errors.Is(err, http2.ErrFrameTooLarge) {
		return fh, &connError{code: http2.ErrCodeFrameSize, msg: fmt.Sprintf("frame of %d bytes", fh.Length), err: err}
	}
	return fh, err
}

// readForHeader reads the rest of the frame of fh (a header block with its
// CONTINUATION frames); a block over maxHeaderBlock or a frame over our
// size is a connection error (PROTOCOL_ERROR, FRAME_SIZE_ERROR).
func (r *h2Reader) readForHeader(fh http2.FrameHeader) (http2.Frame, error) {
	block := fh.Type == http2.FrameHeaders && !fh.Flags.Has(http2.FlagHeadersEndHeaders)
	if block {
		r.block.start()
	}
	f, err := r.fr.ReadFrameForHeader(fh)
	if block {
		r.block.stop()
	}
	switch {
	case errors.Is(err, errHeaderBlockTooLong):
		return nil, &connError{code: http2.ErrCodeProtocol, msg: err.Error(), err: err}
	case errors.Is(err, http2.ErrFrameTooLarge):
		return nil, &connError{code: http2.ErrCodeFrameSize, msg: err.Error(), err: err}
	}
	return f, err
}

// connErrorDetail adds the Framer's detail of a connection error it
// returned to err.
func (r *h2Reader) connErrorDetail(err error) error {
	if d := r.fr.ErrorDetail(); d != nil {
		return fmt.Errorf("%w: %w", err, d)
	}
	return err
}

// h2Counters count the connections either engine closed, per reason (a
// Server's or a Dialer's, summed over its connections).
type h2Counters struct {
	// controlFloods: a control-frame bound passed (the connection's 1
	// MiB, or the Budget's Control).
	controlFloods atomic.Uint64
	// writeTimeouts: a frame write did not finish within WriteTimeout.
	writeTimeouts atomic.Uint64
	// pingTimeouts: no ack of our PING within PingTimeout.
	pingTimeouts atomic.Uint64
	// protocolErrors: a connection error of the peer's (RFC 9113 §5.4.1:
	// GOAWAY with an error code, then close), the SETTINGS entry cap and
	// the header block cap included.
	protocolErrors atomic.Uint64
}

// countClose counts a connection closed with err, when err is a write's
// deadline.
func (n *h2Counters) countClose(err error) {
	if err != nil && isTimeout(err) {
		n.writeTimeouts.Add(1)
	}
}

// streamState is a stream's state (RFC 9113 §5.1) as both engines keep it,
// under their connection's lock. A CONNECT stream leaves idle when its
// HEADERS go out (client) or arrive (server: half-closed (remote) at once
// when they carry END_STREAM); push is disabled, so the reserved states do
// not occur. Each END_STREAM closes one half (closeLocal, closeRemote);
// a reset or the connection's close closes both. Where an engine's data
// path needs the remote half under the stream's own lock (the receive
// queue's end), it keeps that flag there too.
type streamState uint8

const (
	stateIdle             streamState = iota
	stateOpen                         // both halves open
	stateHalfClosedLocal              // our END_STREAM sent
	stateHalfClosedRemote             // the peer's END_STREAM received
	stateClosed                       // both ended, or reset
)

var streamStateNames = [...]string{"idle", "open", "half-closed (local)", "half-closed (remote)", "closed"}

// String returns the state's name as RFC 9113 §5.1 writes it.
func (s streamState) String() string {
	if int(s) < len(streamStateNames) {
		return streamStateNames[s]
	}
	return "invalid"
}

// closeLocal is the state after our END_STREAM.
func (s streamState) closeLocal() streamState {
	switch s {
	case stateOpen:
		return stateHalfClosedLocal
	case stateHalfClosedRemote:
		return stateClosed
	}
	return s
}

// closeRemote is the state after the peer's END_STREAM.
func (s streamState) closeRemote() streamState {
	switch s {
	case stateOpen:
		return stateHalfClosedRemote
	case stateHalfClosedLocal:
		return stateClosed
	}
	return s
}

// localClosed reports whether we send no more DATA on the stream.
func (s streamState) localClosed() bool { return s == stateHalfClosedLocal || s == stateClosed }

// h2Recv is one stream's receive window, under the stream's lock in both
// engines: recvWin is what the peer may still send, credit what was
// consumed (taken by the upstream, or by Read) and not granted back yet.
type h2Recv struct {
	recvWin, credit int64
}

// consume takes n bytes of DATA (with padding) from the window; false,
// taking nothing, when they do not fit (a flow-control error).
func (r *h2Recv) consume(n int64) bool {
	if n > r.recvWin {
		return false
	}
	r.recvWin -= n
	return true
}

// grant counts n bytes consumed and returns stream id's WINDOW_UPDATE
// once a quarter of window is due (added back to recvWin), nil before or
// once the peer ended the stream (ended).
func (r *h2Recv) grant(id uint32, n, window int64, ended bool) []byte {
	r.credit += n
	if ended || r.credit < window/4 {
		return nil
	}
	inc := r.credit
	r.credit = 0
	r.recvWin += inc
	return appendWindowUpdate(nil, id, uint32(inc))
}
