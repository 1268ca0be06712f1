package hbone

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

// h2Out is the write side both HTTP/2 engines share (the Server's h2Conn
// and the Dialer's h2Client). Frame writes are serialized by wmu. Control
// frames (SETTINGS and PING acks, WINDOW_UPDATE, RST_STREAM, GOAWAY, PING)
// are appended to ctl and written ahead of the next write, or by the
// engine's writer goroutine when wake is signaled: a read loop never waits
// for the connection's writer. The queue is bounded by maxQueuedControl,
// and what it holds beyond controlFloor, queued or being written, is
// charged to the node's Budget (BudgetConfig.Control).
//
// It also keeps the connection's receive window (recvConn), whose
// WINDOW_UPDATEs go through that queue.
type h2Out struct {
	conn    h2Transport
	wmu     sync.Mutex
	cmu     sync.Mutex
	ctl     []byte
	spare   []byte
	wake    chan struct{}
	flooded atomic.Bool // a control bound was passed: closing
	// onFlood runs once, on the goroutine that passed maxQueuedControl
	// or the budget's Control (err says which; possibly under the engine's
	// locks): it closes the connection from another goroutine.
	onFlood func(err error)
	// h2Share's budget is charged what ctl holds beyond controlFloor
	// (charged, under cmu). outClosed: the connection closed, nothing
	// more is queued.
	h2Share
	charged   int64
	outClosed bool
	recvConn  recvWindow // bytes consumed are granted back
	// writeTimeout bounds every write (wmu held): a peer that does not
	// read fails the write, and the engine closes the connection.
	writeTimeout time.Duration
	keep         h2Keepalive // the ping check
	errs         *h2Counters // the engine's: why its connections closed
}

// initOut sets the connection, its receive window (the share reserved),
// the write timeout, the counters and the flood hook.
func (o *h2Out) initOut(conn h2Transport, connWindow int, writeTimeout time.Duration, errs *h2Counters, onFlood func(error)) {
	o.conn, o.wake, o.onFlood, o.writeTimeout, o.errs = conn, make(chan struct{}, 1), onFlood, writeTimeout, errs
	o.recvConn.init(connWindow)
}

// shut closes the connection's socket and gives back what it held: the
// control queue and its charge, the Budget's share (window, tokens).
func (o *h2Out) shut() {
	_ = o.conn.Close()
	o.closeOut()
	o.releaseShare()
}

// controlFloor is what a connection's control-frame queue holds without a
// charge to the Budget: a peer that reads never leaves more queued (a
// queue is written ahead of every frame write), so the node's bound
// closes only connections whose peer does not read.
const controlFloor = 16 << 10

// Why a connection's control queue was closed (h2Out.onFlood).
var (
	errControlFlood  = errors.New("over 1 MiB of control frames queued for a peer that does not read")
	errControlBudget = errors.New("control frames queued for a peer that does not read: the node's or its source's control-frame budget is spent")
)

// closeOut drops the queue and its charge when the connection closes; a
// write in flight gives its own back when it returns.
func (o *h2Out) closeOut() {
	o.cmu.Lock()
	o.outClosed = true
	charged := o.charged
	o.ctl, o.spare, o.charged = nil, nil, 0
	o.cmu.Unlock()
	o.budget.releaseControl(o.src, charged)
}

// armLocked sets the deadline of the write about to start (wmu held).
func (o *h2Out) armLocked(d time.Duration) {
	if d > 0 {
		_ = o.conn.SetWriteDeadline(time.Now().Add(d))
	}
}

// writeFramesWithin is writeFrames with its own deadline d (a GOAWAY
// before the close).
func (o *h2Out) writeFramesWithin(d time.Duration, b []byte) error {
	o.wmu.Lock()
	defer o.wmu.Unlock()
	return o.writeWithinLocked(d, b)
}

// queue appends control frames for the next write and wakes the writer.
// Past maxQueuedControl it drops them and, the first time, calls onFlood:
// the peer does not read what it asks for.
func (o *h2Out) queue(b []byte) {
	o.cmu.Lock()
	if o.outClosed {
		o.cmu.Unlock()
		return
	}
	n := len(o.ctl) + len(b)
	var over error
	if n > maxQueuedControl {
		over = errControlFlood
	} else if extra := int64(n-controlFloor) - o.charged; extra > 0 {
		if o.budget.chargeControl(o.src, extra) {
			o.charged += extra
		} else {
			over = errControlBudget
		}
	}
	if over == nil {
		o.ctl = append(o.ctl, b...)
	}
	o.cmu.Unlock()
	if over != nil {
		if o.flooded.CompareAndSwap(false, true) {
			o.errs.controlFloods.Add(1)
			o.onFlood(over)
		}
		return
	}
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// startKeepalive starts the ping check (h2Keepalive): PINGs go through the
// queue, and expire (which closes the connection) runs, counted, when one
// is not acknowledged in time.
func (o *h2Out) startKeepalive(interval, timeout time.Duration, expire func()) {
	o.keep.start(interval, timeout, o.queue, func() {
		o.errs.pingTimeouts.Add(1)
		expire()
	})
}

// sendGoAway sends GOAWAY with last and code ahead of a close for a connection
// error, within goAwayTimeout (a peer that does not read does not hold the
// caller), and counts the error.
func (o *h2Out) sendGoAway(last uint32, code http2.ErrCode) {
	if code != http2.ErrCodeNo {
		o.errs.protocolErrors.Add(1)
	}
	o.queue(appendGoAway(nil, last, code))
	_ = o.writeFramesWithin(goAwayTimeout, nil)
}

// creditConn returns n consumed bytes to the connection's receive window;
// a WINDOW_UPDATE goes out once a quarter of the window is due.
func (o *h2Out) creditConn(n int64) {
	if wu := o.recvConn.give(n); wu != nil {
		o.queue(wu)
	}
}

// writeFrames writes the queued control frames, then b, in one write(2).
func (o *h2Out) writeFrames(b []byte) error {
	o.wmu.Lock()
	defer o.wmu.Unlock()
	return o.writeFramesLocked(b)
}

// writePreface writes b, a connection preface (the client's magic and
// SETTINGS, or the server's SETTINGS), and then the control frames queued
// meanwhile, in one write(2): RFC 9113 §3.4 makes the preface the first
// thing either side sends, and a SETTINGS ack or a PING queued before it
// (the read loop or keepalive ran first) would go ahead of it otherwise.
// start, when set, runs with the write lock held, before the write: the
// loops it starts may queue frames but write none before the preface.
func (o *h2Out) writePreface(b []byte, start func()) error {
	o.wmu.Lock()
	defer o.wmu.Unlock()
	if start != nil {
		start()
	}
	o.conn.beginBatch()
	o.armLocked(o.writeTimeout)
	_, err := o.conn.Write(b)
	if err == nil {
		err = o.writeQueuedLocked()
	}
	if ferr := o.conn.endBatch(); err == nil {
		err = ferr
	}
	return err
}

// writeFramesLocked is writeFrames with wmu held.
func (o *h2Out) writeFramesLocked(b []byte) error { return o.writeWithinLocked(o.writeTimeout, b) }

// writeWithinLocked writes the queued control frames, then b, in one
// write(2) with deadline d (wmu held).
func (o *h2Out) writeWithinLocked(d time.Duration, b []byte) error {
	o.conn.beginBatch()
	o.armLocked(d)
	err := o.writeQueuedLocked()
	if err == nil && len(b) > 0 {
		_, err = o.conn.Write(b)
	}
	if ferr := o.conn.endBatch(); err == nil {
		err = ferr
	}
	return err
}

// writeQueuedLocked writes the queued control frames (wmu held).
func (o *h2Out) writeQueuedLocked() error {
	o.cmu.Lock()
	b, charged := o.ctl, o.charged
	o.ctl, o.spare, o.charged = o.spare, nil, 0
	o.cmu.Unlock()
	if len(b) == 0 {
		return nil
	}
	_, err := o.conn.Write(b)
	o.budget.releaseControl(o.src, charged) // held while being written
	o.cmu.Lock()
	if !o.outClosed {
		o.spare = b[:0]
	}
	o.cmu.Unlock()
	return err
}

// writeControl writes the queued control frames whenever wake is signaled,
// until done is closed (nil) or a write fails (its error). after, when
// set, runs after each write; the loop ends (nil) when it returns true.
func (o *h2Out) writeControl(done <-chan struct{}, after func() bool) error {
	for {
		select {
		case <-o.wake:
		case <-done:
			return nil
		}
		if err := o.writeFrames(nil); err != nil {
			return err
		}
		if after != nil && after() {
			return nil
		}
	}
}

// recvWindow is a connection's receive window, shared by both engines:
// left is what the peer may still send, credit what was consumed and not
// granted back yet.
type recvWindow struct {
	size         int64
	left, credit atomic.Int64
}

func (w *recvWindow) init(size int) {
	w.size = int64(size)
	w.left.Store(w.size)
}

// give returns n consumed bytes to the window and, once a quarter of it is
// due, the connection WINDOW_UPDATE to send (nil before).
func (w *recvWindow) give(n int64) []byte {
	if n <= 0 || w.credit.Add(n) < w.size/4 {
		return nil
	}
	inc := w.credit.Swap(0)
	if inc <= 0 {
		return nil
	}
	w.left.Add(inc)
	return appendWindowUpdate(nil, 0, uint32(inc))
}

// maxSettings is the most entries a SETTINGS frame may carry (x/net's
// server closes the connection past 100 as well).
const maxSettings = 100

// pingData is the payload of our keepalive PINGs.
var pingData = [8]byte{'h', 'b', 'o', 'n', 'e'}

// h2Keepalive is the ping check both engines run: every interval, a
// connection whose peer acknowledged nothing since the last check gets a
// PING, and expire runs when timeout passes without its ack. Only the
// acks of our PINGs count: they show the peer reads what we send, where
// any other frame (a PRIORITY every 100 ms) shows only that it writes.
type h2Keepalive struct {
	frames atomic.Uint64 // acks of our PINGs

	mu                sync.Mutex
	timer             *time.Timer
	stopped, pinging  bool
	last              uint64 // frames at the last check
	interval, timeout time.Duration
	queue             func([]byte)
	expire            func()
}

// start arms the check; queue sends a PING, expire closes the connection.
func (k *h2Keepalive) start(interval, timeout time.Duration, queue func([]byte), expire func()) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped {
		return
	}
	k.interval, k.timeout, k.queue, k.expire = interval, timeout, queue, expire
	k.timer = time.AfterFunc(interval, k.check)
}

func (k *h2Keepalive) check() {
	k.mu.Lock()
	switch {
	case k.stopped:
		k.mu.Unlock()
	case k.pinging:
		k.stopped = true
		k.mu.Unlock()
		k.expire()
	case k.frames.Load() != k.last:
		k.last = k.frames.Load()
		k.timer.Reset(k.interval)
		k.mu.Unlock()
	default:
		k.pinging = true
		k.timer.Reset(k.timeout)
		k.mu.Unlock()
		k.queue(appendPing(nil, false, pingData))
	}
}

// acked takes a PING ack; only the ack of a PING of ours in flight
// counts (an unsolicited one shows nothing).
func (k *h2Keepalive) acked() {
	k.mu.Lock()
	if k.pinging {
		k.pinging = false
		k.frames.Add(1)
	}
	k.mu.Unlock()
}

// stop ends the check (the connection closed).
func (k *h2Keepalive) stop() {
	k.mu.Lock()
	k.stopped = true
	if k.timer != nil {
		k.timer.Stop()
	}
	k.mu.Unlock()
}

// writeDataLocked sends m bytes of b, from b[off+frameHeaderLen:], as DATA
// frames of stream id, with wmu held and in one batch of the record
// batcher: each frame's header is written into the 9 bytes before its
// payload (the first into room the caller left, each later one over the
// tail of the payload just sent) and goes out with its payload in one TLS
// write. size gives each frame's payload length from the bytes left;
// wrote, when set, is told each frame's. It returns the new off.
func (o *h2Out) writeDataLocked(b []byte, off, m int, id uint32, size func(left int) int, wrote func(int)) (int, error) {
	o.conn.beginBatch()
	o.armLocked(o.writeTimeout)
	err := o.writeQueuedLocked()
	for err == nil && m > 0 {
		k := size(m)
		putFrameHeader(b[off:], k, http2.FrameData, 0, id)
		_, err = o.conn.Write(b[off : off+frameHeaderLen+k])
		off += k
		m -= k
		if err == nil && wrote != nil {
			wrote(k)
		}
	}
	if ferr := o.conn.endBatch(); err == nil {
		err = ferr
	}
	return off, err
}

// h2Handler is what an engine does with the frames whose handling is its
// own; handleFrame does the rest.
type h2Handler interface {
	onDataFrame(*http2.DataFrame) error
	onHeaders(*http2.MetaHeadersFrame) error
	onSettings(*http2.SettingsFrame) error
	onWindowUpdate(*http2.WindowUpdateFrame) error
	onRSTStream(*http2.RSTStreamFrame) error
	onGoAway(*http2.GoAwayFrame)
}

// handleFrame processes one frame read by either engine (an error is a
// connection error): PINGs are answered through queue and acks go to
// keep, SETTINGS acks and PRIORITY and unknown frame types are ignored
// (RFC 9113 §5.5, §6.3), PUSH_PROMISE is an error (neither side enables
// push: a server must not send it, a client cannot), the rest goes to h.
func handleFrame(h h2Handler, queue func([]byte), keep *h2Keepalive, f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		return h.onDataFrame(f)
	case *http2.MetaHeadersFrame:
		return h.onHeaders(f)
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if f.NumSettings() > maxSettings {
			// As x/net's server: every entry is applied under the
			// engine's lock (INITIAL_WINDOW_SIZE walks every stream).
			// Duplicates within the cap are legal (RFC 9113 §6.5.3:
			// the last value applies; h2spec http2/6.5.3/1), and cost
			// at most maxSettings walks, so unlike x/net they are
			// accepted.
			return connErrorf(http2.ErrCodeProtocol, "SETTINGS with %d entries: at most %d allowed", f.NumSettings(), maxSettings)
		}
		return h.onSettings(f)
	case *http2.WindowUpdateFrame:
		return h.onWindowUpdate(f)
	case *http2.RSTStreamFrame:
		return h.onRSTStream(f)
	case *http2.PingFrame:
		if !f.IsAck() {
			queue(appendPing(nil, true, f.Data))
			return nil
		}
		keep.acked()
	case *http2.GoAwayFrame:
		h.onGoAway(f)
	case *http2.PushPromiseFrame:
		return connErrorf(http2.ErrCodeProtocol, "PUSH_PROMISE with push disabled")
	}
	return nil
}
