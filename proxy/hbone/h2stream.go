package hbone

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"syscall"

	"golang.org/x/net/http2"
)

// errStreamStopped ends a stream's copy when the stream was reset or its
// connection closed: nothing more is sent on it.
var errStreamStopped = errors.New("hbone stream stopped")

// h2Stream is one CONNECT stream of an h2Conn.
type h2Stream struct {
	c      *h2Conn
	id     uint32
	ctx    context.Context // canceled when the stream stops
	cancel context.CancelFunc
	target netip.AddrPort // the CONNECT authority
	// started: serve runs (set by the read loop before it starts it).
	started bool

	// The send side (its window under c.mu): the stream's sendGate.
	h2Send
	// state is under c.mu: closed once reset (either side), the
	// connection closed, or the response ended: no more frames.
	state streamState

	// Under mu: the receive side (client → upstream).
	mu        sync.Mutex
	up        net.Conn        // the delivered upstream; nil until Deliver returns
	raw       syscall.RawConn // up's socket, written without waiting; nil: queue only
	wrote     func(int)       // a SocketConn's SocketWritten
	h2Recv                    // receive window; credit: bytes up took, not granted back yet
	pending   []*[]byte       // DATA up could not take yet (pooled buffers)
	draining  bool            // a goroutine writes pending
	remoteEnd bool            // END_STREAM received
	closedUp  bool            // CloseWrite passed on
	closedIn  bool            // up closed: inbound DATA is dropped
}

// pendBufs hold queued DATA of streams whose upstream is slower than the
// client (or not delivered yet).
const pendBuf = 16 << 10

var pendBufs = sync.Pool{New: func() any { b := make([]byte, 0, pendBuf); return &b }}

// serve delivers the stream, answers it, and copies the upstream into it.
func (st *h2Stream) serve() {
	c, s, target := st.c, st.c.s, st.target
	defer s.wg.Done()
	defer c.removeStream(st)
	defer st.cancel()
	up, err := s.cfg.Deliver(st.ctx, c.peer, target)
	if err != nil {
		s.stat.streamsDeliverFailed.Add(1)
		code := http.StatusServiceUnavailable
		var se *StatusError
		if errors.As(err, &se) {
			code = se.Code
		}
		if held, ok := s.deliverLog.allow(); ok {
			s.log.Error("failed to deliver hbone stream", "source_id", c.peer.String(), "target", target.String(), "error", err, "suppressed", held)
		}
		if !st.isStopped() {
			st.mu.Lock()
			ended := st.remoteEnd
			st.mu.Unlock()
			b := appendStatus(nil, st.id, code, true)
			if !ended {
				b = appendRSTStream(b, st.id, http2.ErrCodeNo)
			}
			_ = c.writeFrames(b)
		}
		st.closeIn()
		return
	}
	s.stat.streamsOpened.Add(1)
	s.stat.streamsActive.Add(1)
	defer s.stat.streamsActive.Add(-1)
	if !st.attach(up) {
		return
	}
	if err := c.writeFrames(appendStatus(nil, st.id, http.StatusOK, false)); err != nil {
		c.close(err)
		st.closeIn()
		return
	}
	err = readChunks(up, frameHeaderLen, st, st.sendTaken)
	st.dropHeld() // the copy ended between a wait and its take
	if o, ok := up.(ReadObserver); ok {
		o.ReadDone(err)
	}
	if !st.isStopped() {
		var b []byte
		if err == nil {
			// The upstream ended: so does the response (END_STREAM). The
			// request side is reset (RST_STREAM NO_ERROR) when still open,
			// as before (README.md, "Wire format" 5).
			b = appendFrameHeader(nil, 0, http2.FrameData, http2.FlagDataEndStream, st.id)
			st.mu.Lock()
			ended := st.remoteEnd
			st.mu.Unlock()
			if !ended {
				b = appendRSTStream(b, st.id, http2.ErrCodeNo)
			}
		} else {
			// The upstream failed (reset, or closed under the copy: the
			// data plane's idle timeout, the pod closing): reset the
			// stream as a TCP proxy resets its client.
			b = appendRSTStream(nil, st.id, http2.ErrCodeInternal)
		}
		c.mu.Lock()
		st.state = stateClosed
		c.mu.Unlock()
		_ = c.writeFrames(b)
	}
	st.closeIn()
}

// attach sets the delivered upstream; false when the stream stopped
// meanwhile (up is closed).
func (st *h2Stream) attach(up net.Conn) bool {
	raw, wrote := rawSocket(up)
	st.mu.Lock()
	if st.closedIn {
		st.mu.Unlock()
		_ = up.Close()
		return false
	}
	st.up, st.raw, st.wrote = up, raw, wrote
	st.kickLocked()
	st.mu.Unlock()
	if a, ok := up.(Abortable); ok {
		a.OnAbort(st.abort)
	}
	return true
}

// abort resets the stream because its upstream was aborted under it.
func (st *h2Stream) abort() {
	c := st.c
	c.mu.Lock()
	live := c.streams[st.id] == st && st.state != stateClosed
	c.mu.Unlock()
	if live {
		c.streamError(st.id, http2.ErrCodeInternal)
	}
}

// kickLocked starts the writer of pending data, or passes the client's
// END_STREAM on when nothing is pending (st.mu held).
func (st *h2Stream) kickLocked() {
	switch {
	case st.up == nil || st.draining || st.closedIn:
	case len(st.pending) > 0:
		st.draining = true
		st.c.s.wg.Add(1)
		go st.drain()
	case st.remoteEnd && !st.closedUp:
		st.closedUp = true
		closeWrite(st.up)
	}
}

// sendErrLocked is why the stream sends no more (c.mu held): it stopped.
func (st *h2Stream) sendErrLocked() error {
	if st.state == stateClosed {
		return errStreamStopped
	}
	return nil
}

// sendStop is closed when the stream stops (its context ends then).
func (st *h2Stream) sendStop() <-chan struct{} { return st.ctx.Done() }

func (st *h2Stream) isStopped() bool {
	st.c.mu.Lock()
	defer st.c.mu.Unlock()
	return st.state == stateClosed
}

// stop ends the stream without further frames of ours (it was reset).
func (st *h2Stream) stop() {
	st.c.mu.Lock()
	st.state = stateClosed
	st.c.cond.Broadcast()
	st.c.mu.Unlock()
	st.cancel()
	st.closeIn()
}

// closeIn closes the upstream and drops pending data (its bytes go back to
// the connection window).
func (st *h2Stream) closeIn() {
	st.mu.Lock()
	if st.closedIn {
		st.mu.Unlock()
		return
	}
	st.closedIn = true
	up := st.up
	var dropped int64
	for _, b := range st.pending {
		dropped += int64(len(*b))
		putPend(b)
	}
	st.pending = nil
	st.mu.Unlock()
	st.c.creditConn(dropped)
	if up != nil {
		_ = up.Close()
	}
}

// onData takes a DATA payload (n bytes of window with padding) and
// END_STREAM: written to the upstream now when it takes it, else queued.
func (st *h2Stream) onData(data []byte, n int64, end bool) {
	c := st.c
	st.mu.Lock()
	if st.closedIn {
		st.mu.Unlock()
		c.creditConn(n) // after our RST_STREAM: ignored
		return
	}
	if st.remoteEnd {
		st.mu.Unlock()
		c.creditConn(n)
		c.streamError(st.id, http2.ErrCodeStreamClosed)
		return
	}
	if !st.consume(n) {
		st.mu.Unlock()
		c.creditConn(n)
		c.streamError(st.id, http2.ErrCodeFlowControl)
		return
	}
	st.remoteEnd = end
	st.pushLocked(data, n, n-int64(len(data)))
	if end {
		c.mu.Lock()
		st.state = st.state.closeRemote()
		c.mu.Unlock()
	}
}

// pushLocked writes data (accounted as n bytes of window, of which taken
// are already done with: padding) to the upstream now when it takes it,
// queues the rest, and unlocks st.mu.
func (st *h2Stream) pushLocked(data []byte, n, taken int64) {
	c := st.c
	if st.closedIn {
		st.mu.Unlock()
		c.creditConn(n) // the upstream is gone: dropped
		return
	}
	if len(data) > 0 && st.fastLocked() {
		// Fast path: the upstream takes what it can now. The write does
		// not block (tryWrite: one write(2), EAGAIN leaves the rest
		// queued), so st.mu stays held across it and its count: a
		// closeIn from another goroutine (an abort, a policy closing
		// the stream) cannot close the upstream, and its access-log line
		// be written, between the bytes reaching the app and being
		// counted (bytes_to_dst 0 for bytes the app had echoed).
		w, err := tryWrite(st.raw, data)
		if w > 0 && st.wrote != nil {
			st.wrote(w)
		}
		if err != nil {
			// The upstream failed: close it; the stream's copy then
			// resets the stream.
			st.mu.Unlock()
			st.closeIn()
			c.creditConn(n)
			return
		}
		data = data[w:]
		taken += int64(w)
	}
	for len(data) > 0 {
		b := pendBufs.Get().(*[]byte)
		k := min(len(data), pendBuf)
		*b = append((*b)[:0], data[:k]...)
		st.pending = append(st.pending, b)
		data = data[k:]
	}
	st.kickLocked()
	wu := st.creditLocked(taken)
	st.mu.Unlock()
	if wu != nil {
		c.queue(wu)
	}
	c.creditConn(taken)
}

// fastLocked reports whether DATA can be written to the upstream's socket
// right away (st.mu held): delivered, a socket, nothing queued before it.
func (st *h2Stream) fastLocked() bool {
	return st.raw != nil && !st.draining && len(st.pending) == 0 && !st.closedIn
}

// creditLocked counts n bytes taken by the upstream and returns a stream
// WINDOW_UPDATE once a quarter of the window is due (st.mu held).
func (st *h2Stream) creditLocked(n int64) []byte {
	return st.grant(st.id, n, int64(st.c.s.cfg.StreamWindow), st.remoteEnd)
}

// drain writes pending data to the upstream, waiting as long as it takes,
// then passes END_STREAM on when it came.
func (st *h2Stream) drain() {
	defer st.c.s.wg.Done()
	for {
		st.mu.Lock()
		if st.closedIn || len(st.pending) == 0 {
			st.draining = false
			st.kickLocked()
			st.mu.Unlock()
			return
		}
		b := st.pending[0]
		st.pending[0] = nil
		st.pending = st.pending[1:]
		up := st.up
		st.mu.Unlock()
		n, err := up.Write(*b)
		putPend(b)
		if err != nil {
			st.mu.Lock()
			st.draining = false
			st.mu.Unlock()
			st.closeIn()
			st.c.creditConn(int64(n))
			return
		}
		st.mu.Lock()
		wu := st.creditLocked(int64(n))
		st.mu.Unlock()
		if wu != nil {
			st.c.queue(wu)
		}
		st.c.creditConn(int64(n))
	}
}

func putPend(b *[]byte) {
	*b = (*b)[:0]
	pendBufs.Put(b)
}

// sendTaken sends b[frameHeaderLen:], whose windows take reserved, as DATA
// frames; b[:frameHeaderLen] is room for the first frame's header, and
// each later header is written over the payload just sent.
func (st *h2Stream) sendTaken(b []byte) error {
	c := st.c
	c.mu.Lock()
	stopped, maxFrame := st.state == stateClosed, c.peerMaxFrame
	c.mu.Unlock()
	if stopped {
		return errStreamStopped
	}
	c.wmu.Lock()
	_, err := c.writeDataLocked(b, 0, len(b)-frameHeaderLen, st.id, func(left int) int { return min(left, maxFrame) }, nil)
	c.wmu.Unlock()
	if err != nil {
		c.close(err)
		return err
	}
	return nil
}
