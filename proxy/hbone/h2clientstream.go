package hbone

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

// ErrDeadlineUnsupported is returned by a Stream's deadline setters.
var ErrDeadlineUnsupported = errors.New("hbone stream deadlines are not supported")

var errWriteAfterClose = errors.New("failed to write to hbone stream: write side closed")

// Stream is one HBONE CONNECT stream; it implements net.Conn without
// deadlines (they return ErrDeadlineUnsupported) and CloseWrite, which sends
// END_STREAM.
type Stream struct {
	c        *h2Client
	id       uint32
	target   netip.AddrPort
	peer     spiffeid.ID
	answered chan struct{} // closed when the CONNECT got its answer or failed

	// The send side (its window under c.mu): the stream's sendGate.
	h2Send
	// Under c.mu: the send side's end, and whether the stream still
	// holds a slot.
	state   streamState   // the END_STREAMs sent and received
	sendErr error         // writes fail with it
	stop    chan struct{} // sendStop's, made when first asked for
	stopped bool          // stop is closed

	rmu sync.Mutex // serializes Reads

	// Under mu: the receive side.
	mu        sync.Mutex
	cond      sync.Cond // data, the end, or an error arrived
	settled   bool      // answered is closed
	open      bool      // 200 received
	dialErr   error     // the CONNECT failed
	h2Recv              // receive window; credit: bytes Read took, not granted back yet
	queue     []rxChunk // DATA no Read was waiting for
	queued    int       // bytes in queue
	filling   bool      // the read loop reads into the queue's last chunk
	rbuf      []byte    // a waiting Read's buffer, offered to the read loop
	rfill     bool      // the read loop reads into rbuf
	rn        int       // bytes the read loop put into a Read's buffer
	remoteEnd bool      // END_STREAM received: EOF after the queue
	rerr      error     // Read fails with it after the queue
	closed    bool      // Close was called
}

// rxChunk is a pooled buffer of queued DATA: (*buf)[off:] is unread.
type rxChunk struct {
	buf *[]byte
	off int
}

var _ net.Conn = (*Stream)(nil)

// Peer returns the verified SPIFFE ID of the destination proxy.
func (s *Stream) Peer() spiffeid.ID { return s.peer }

// Read reads what the target sent; io.EOF after the server ends the stream.
// A failed stream or connection is an error, never io.EOF.
func (s *Stream) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	s.rmu.Lock()
	defer s.rmu.Unlock()
	s.mu.Lock()
	for {
		n := 0
		switch {
		case s.rn > 0:
			// Read into p by the read loop; anything queued came after.
			n, s.rn = s.rn, 0
		case s.queued > 0:
			n = s.takeLocked(p)
		case s.rfill:
			// The read loop is reading into p.
		case s.rerr != nil:
			s.rbuf = nil
			err := s.rerr
			s.mu.Unlock()
			return 0, err
		case s.remoteEnd:
			s.rbuf = nil
			s.mu.Unlock()
			return 0, io.EOF
		default:
			s.rbuf = p
		}
		if n > 0 {
			s.rbuf = nil
			wu := s.creditLocked(n)
			s.mu.Unlock()
			if wu != nil {
				s.c.queue(wu)
			}
			s.c.creditConn(int64(n))
			return n, nil
		}
		s.cond.Wait()
	}
}

// takeLocked copies queued data into p and releases the chunks read.
func (s *Stream) takeLocked(p []byte) int {
	n := 0
	for n < len(p) && len(s.queue) > 0 {
		ch := &s.queue[0]
		k := copy(p[n:], (*ch.buf)[ch.off:])
		ch.off += k
		n += k
		if ch.off < len(*ch.buf) || len(s.queue) == 1 && s.filling {
			break
		}
		putPend(ch.buf)
		s.queue[0] = rxChunk{}
		s.queue = s.queue[1:]
	}
	if len(s.queue) == 0 {
		s.queue = nil
	}
	s.queued -= n
	return n
}

// creditLocked counts n bytes taken by Read and returns a stream
// WINDOW_UPDATE once a quarter of the window is due (mu held).
func (s *Stream) creditLocked(n int) []byte {
	return s.grant(s.id, int64(n), int64(s.c.cfg.StreamWindow), s.remoteEnd)
}

// dropQueueLocked releases the queue and returns how many bytes it held
// (mu held, not filling).
func (s *Stream) dropQueueLocked() int64 {
	n := int64(s.queued)
	for _, ch := range s.queue {
		putPend(ch.buf)
	}
	s.queue, s.queued = nil, 0
	return n
}

// onData takes the payload of a DATA frame (read loop): data when it was
// read already (padded frames), else n bytes still to be read from the
// connection, into a waiting Read's buffer when there is one.
func (s *Stream) onData(fh http2.FrameHeader, n int64, data []byte) error {
	c := s.c
	s.mu.Lock()
	if n > s.recvWin {
		s.mu.Unlock()
		return connErrorf(http2.ErrCodeFlowControl, "DATA beyond the window of stream %d", s.id)
	}
	if !s.open || s.remoteEnd || s.closed {
		bad := !s.closed
		s.mu.Unlock()
		c.creditConn(n)
		if bad {
			c.streamError(s.id, http2.ErrCodeStreamClosed, errors.New("server sent DATA outside an open response"))
		}
		if data == nil {
			return c.discard(n)
		}
		return nil
	}
	s.recvWin -= n
	if data != nil {
		for len(data) > 0 {
			buf := s.tailLocked()
			k := min(cap(*buf)-len(*buf), len(data))
			*buf = append(*buf, data[:k]...)
			s.queued += k
			data = data[k:]
		}
	}
	for rem := int(n); data == nil && rem > 0; {
		var dst []byte
		direct := s.rbuf != nil && s.queued == 0
		var buf *[]byte
		if direct {
			dst = s.rbuf[:min(len(s.rbuf), rem)]
			s.rbuf, s.rfill = nil, true
		} else {
			buf = s.tailLocked()
			lo := len(*buf)
			dst = (*buf)[lo:min(cap(*buf), lo+rem)]
			s.filling = true
		}
		s.mu.Unlock()
		_, err := io.ReadFull(c.conn, dst)
		s.mu.Lock()
		s.rfill, s.filling = false, false
		if err != nil {
			s.cond.Broadcast()
			s.mu.Unlock()
			return err
		}
		rem -= len(dst)
		switch {
		case direct:
			s.rn += len(dst)
		case s.closed:
			c.creditConn(int64(len(dst)) + s.dropQueueLocked())
		default:
			*buf = (*buf)[:len(*buf)+len(dst)]
			s.queued += len(dst)
		}
	}
	end := fh.Flags.Has(http2.FlagDataEndStream)
	if end {
		s.remoteEnd = true
	}
	s.cond.Broadcast()
	s.mu.Unlock()
	if end {
		s.ended()
	}
	return nil
}

// tailLocked returns the queue's last chunk when it has room, else a new
// one appended to the queue (mu held).
func (s *Stream) tailLocked() *[]byte {
	if k := len(s.queue); k > 0 {
		if b := s.queue[k-1].buf; len(*b) < cap(*b) {
			return b
		}
	}
	b := pendBufs.Get().(*[]byte)
	s.queue = append(s.queue, rxChunk{buf: b})
	return b
}

// onAnswer takes the CONNECT's answer: nil for 200, else the error Dial
// returns; end when it ended the stream.
func (s *Stream) onAnswer(err error, end bool) {
	s.mu.Lock()
	if s.settled {
		s.mu.Unlock()
		return
	}
	s.settled = true
	if err != nil {
		s.dialErr, s.rerr = err, err
	} else {
		s.open = true
		s.remoteEnd = end
	}
	s.mu.Unlock()
	close(s.answered)
	if end && err == nil {
		s.ended()
	}
}

// onEnd takes END_STREAM carried by trailers.
func (s *Stream) onEnd() {
	s.mu.Lock()
	s.remoteEnd = true
	s.cond.Broadcast()
	s.mu.Unlock()
	s.ended()
}

// ended notes the server's END_STREAM; the stream is done (its slot free)
// once ours was sent too.
func (s *Stream) ended() {
	c := s.c
	c.mu.Lock()
	s.state = s.state.closeRemote()
	done := s.state == stateClosed
	c.mu.Unlock()
	if done {
		c.removeStream(s)
	}
}

// onReset takes the server's RST_STREAM.
func (s *Stream) onReset(code http2.ErrCode) {
	s.mu.Lock()
	complete := s.remoteEnd
	s.mu.Unlock()
	switch {
	case code == http2.ErrCodeNo && complete:
		// The response is complete; the server stops our side (README.md,
		// "Wire format" 5).
		s.failSend(errors.New("failed to write to hbone stream: the server closed it"))
	case code == http2.ErrCodeRefusedStream:
		s.fail(errRefused)
	default:
		s.fail(fmt.Errorf("hbone stream reset by the server: %s", code))
	}
	s.c.removeStream(s)
}

// fail ends the stream with err: a pending Dial, Reads (unless the server
// ended the stream: its data ends with EOF) and Writes.
func (s *Stream) fail(err error) {
	s.failSend(err) // first: a Read that sees the failure finds Writes failing too
	s.mu.Lock()
	settle := !s.settled
	s.settled = true
	if settle {
		s.dialErr = err
	}
	if !s.remoteEnd && s.rerr == nil {
		s.rerr = err
	}
	s.cond.Broadcast()
	s.mu.Unlock()
	if settle {
		close(s.answered)
	}
}

// failSend makes Writes fail with err.
func (s *Stream) failSend(err error) {
	c := s.c
	c.mu.Lock()
	if s.sendErr == nil {
		s.sendErr = err
	}
	s.stopLocked()
	c.cond.Broadcast()
	c.mu.Unlock()
}

// sendStop returns a channel closed once the stream sends no more (c.mu
// held): a wait for send-buffer tokens ends with it.
func (s *Stream) sendStop() <-chan struct{} {
	if s.stop == nil {
		s.stop = make(chan struct{})
		if s.sendErrLocked() != nil {
			s.stopLocked()
		}
	}
	return s.stop
}

// stopLocked closes sendStop's channel, if one was made (c.mu held).
func (s *Stream) stopLocked() {
	if s.stop != nil && !s.stopped {
		s.stopped = true
		close(s.stop)
	}
}

// reset ends the stream from our side: RST_STREAM code when it is still
// open, and err for its users.
func (s *Stream) reset(code http2.ErrCode, err error) {
	c := s.c
	c.mu.Lock()
	open := c.streams[s.id] == s
	c.mu.Unlock()
	if open {
		c.queue(appendRSTStream(nil, s.id, code))
	}
	s.fail(err)
	c.removeStream(s)
}

// Write sends p to the target. DATA frames are written from the calling
// goroutine, within the server's flow-control windows and frame size:
// several frames are laid out in one pooled buffer and sent with one TLS
// write. The buffer is a send buffer of the sendGate (the connection's,
// its origin's and the node's bounds), held only while it is written.
func (s *Stream) Write(p []byte) (int, error) {
	written := 0
	for written < len(p) {
		// The window and a send buffer first: a Write waiting for them
		// holds no buffer.
		if err := s.wait(); err != nil {
			return written, err
		}
		m, maxFrame := s.takeFit(len(p)-written, framesFit)
		if m == 0 {
			continue
		}
		stage := sockBufs.Get().(*[]byte)
		b := (*stage)[:0]
		for q := p[written : written+m]; len(q) > 0; {
			k := min(len(q), maxFrame)
			b = appendFrameHeader(b, k, http2.FrameData, 0, s.id)
			b = append(b, q[:k]...)
			q = q[k:]
		}
		err := s.c.writeFrames(b)
		sockBufs.Put(stage)
		s.back(0)
		if err != nil {
			s.c.close(err)
			return written, fmt.Errorf("failed to write to hbone stream: %w", err)
		}
		written += m
	}
	return written, nil
}

// framesFit is how many payload bytes of frames of maxFrame fit, with
// their headers, in one sockBufs buffer.
func framesFit(maxFrame int) int {
	const room = frameHeaderLen + sockBuf // cap of a sockBufs buffer
	if frames := room / (frameHeaderLen + maxFrame); frames > 0 {
		return frames * maxFrame
	}
	return room - frameHeaderLen
}

// tlsRecord is the largest TLS record payload: frames that fill whole
// records cost no extra record for their 9-byte header.
const tlsRecord = 16 << 10

// writeTaken sends b[frameHeaderLen:], whose windows take reserved, as
// DATA frames (Copy's path): b[:frameHeaderLen] is room for the first
// frame's header and each later header is written over the payload just
// sent, so nothing is copied. A frame and its header go out with one TLS
// write, sized to fill whole TLS records where the payload allows; the
// frames share one batch of the record batcher. wrote, when set, is told
// each amount sent.
func (s *Stream) writeTaken(b []byte, wrote func(int)) error {
	c := s.c
	c.mu.Lock()
	maxFrame := c.peerMaxFrame
	c.mu.Unlock()
	c.wmu.Lock()
	_, err := c.writeDataLocked(b, 0, len(b)-frameHeaderLen, s.id, func(left int) int {
		k := min(left, maxFrame)
		if whole := (k+frameHeaderLen)/tlsRecord*tlsRecord - frameHeaderLen; whole > 0 {
			return whole
		}
		return k
	}, wrote)
	c.wmu.Unlock()
	if err != nil {
		c.close(err)
		return fmt.Errorf("failed to write to hbone stream: %w", err)
	}
	return nil
}

// sendErrLocked is why the stream cannot send (c.mu held); nil when it can.
func (s *Stream) sendErrLocked() error {
	c := s.c
	switch {
	case s.sendErr != nil:
		return s.sendErr
	case s.state.localClosed():
		return errWriteAfterClose
	case c.closed:
		return fmt.Errorf("%w: %w", errConnClosed, c.err)
	}
	return nil
}

// CloseWrite half-closes the stream (END_STREAM); Read keeps working.
func (s *Stream) CloseWrite() error {
	c := s.c
	c.mu.Lock()
	if s.state.localClosed() {
		c.mu.Unlock()
		return nil
	}
	if err := s.sendErr; err != nil {
		c.mu.Unlock()
		return err
	}
	s.state = s.state.closeLocal()
	s.stopLocked()
	done := s.state == stateClosed
	c.mu.Unlock()
	err := c.writeFrames(appendFrameHeader(nil, 0, http2.FrameData, http2.FlagDataEndStream, s.id))
	if err != nil {
		c.close(err)
		return fmt.Errorf("failed to close hbone stream for writing: %w", err)
	}
	if done {
		c.removeStream(s)
	}
	return nil
}

// Close resets the stream in both directions (RST_STREAM CANCEL when it is
// still open); its queued data is dropped.
func (s *Stream) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	var dropped int64
	if !s.filling {
		dropped = s.dropQueueLocked()
	}
	s.mu.Unlock()
	s.c.creditConn(dropped)
	s.reset(http2.ErrCodeCancel, fmt.Errorf("%w: %w", errStreamClosed, net.ErrClosed))
	s.mu.Lock()
	s.rerr = fmt.Errorf("%w: %w", errStreamClosed, net.ErrClosed)
	s.cond.Broadcast()
	s.mu.Unlock()
	return nil
}

// LocalAddr returns a placeholder: a stream has no local socket address.
func (s *Stream) LocalAddr() net.Addr { return hboneAddr{} }

// RemoteAddr returns the CONNECT target.
func (s *Stream) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(s.target) }

// SetDeadline is not supported.
func (s *Stream) SetDeadline(time.Time) error { return ErrDeadlineUnsupported }

// SetReadDeadline is not supported.
func (s *Stream) SetReadDeadline(time.Time) error { return ErrDeadlineUnsupported }

// SetWriteDeadline is not supported.
func (s *Stream) SetWriteDeadline(time.Time) error { return ErrDeadlineUnsupported }
