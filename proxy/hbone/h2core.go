package hbone

import "sync"

// The send side of the HTTP/2 core both engines share (the Server's h2Conn
// and the Dialer's h2Client; h2out.go holds the write side): a
// connection's send window and the peer's settings that bound what is sent
// (h2Flow), and each stream's send window and the send buffers it holds
// (h2Send, the sendGate a copy into the stream reads through).

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
