package hbone

import (
	"sync"
	"sync/atomic"
)

// h2Out is the write side both HTTP/2 engines share (the Server's h2Conn
// and the Dialer's h2Client). Frame writes are serialized by wmu. Control
// frames (SETTINGS and PING acks, WINDOW_UPDATE, RST_STREAM, GOAWAY, PING)
// are appended to ctl and written ahead of the next write, or by the
// engine's writer goroutine when wake is signaled: a read loop never waits
// for the connection's writer. The queue is bounded by maxQueuedControl.
type h2Out struct {
	conn    h2Transport
	wmu     sync.Mutex
	cmu     sync.Mutex
	ctl     []byte
	spare   []byte
	wake    chan struct{}
	flooded atomic.Bool // maxQueuedControl was passed: closing
}

func newH2Out(conn h2Transport) h2Out {
	return h2Out{conn: conn, wake: make(chan struct{}, 1)}
}

// enqueue appends control frames for the next write and wakes the writer.
// Past maxQueuedControl it drops them and reports true, once: the caller
// closes the connection (its peer does not read what it asks for).
func (o *h2Out) enqueue(b []byte) bool {
	o.cmu.Lock()
	over := len(o.ctl)+len(b) > maxQueuedControl
	if !over {
		o.ctl = append(o.ctl, b...)
	}
	o.cmu.Unlock()
	if over {
		return o.flooded.CompareAndSwap(false, true)
	}
	select {
	case o.wake <- struct{}{}:
	default:
	}
	return false
}

// writeFrames writes the queued control frames, then b, in one write(2).
func (o *h2Out) writeFrames(b []byte) error {
	o.wmu.Lock()
	defer o.wmu.Unlock()
	return o.writeFramesLocked(b)
}

// writeFramesLocked is writeFrames with wmu held.
func (o *h2Out) writeFramesLocked(b []byte) error {
	o.conn.beginBatch()
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
	b := o.ctl
	o.ctl, o.spare = o.spare, nil
	o.cmu.Unlock()
	if len(b) == 0 {
		return nil
	}
	_, err := o.conn.Write(b)
	o.cmu.Lock()
	o.spare = b[:0]
	o.cmu.Unlock()
	return err
}
