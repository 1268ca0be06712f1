package hbone

import (
	"errors"
	"io"
	"net"
	"sync"
)

// sockBuf is the read size of copies from a socket (the upstream → client
// direction of the server, and Copy into a Stream): a read fills up to this
// much, sent as frames of up to the peer's SETTINGS_MAX_FRAME_SIZE
// (DefaultDialerMaxFrameSize for our Dialer).
const sockBuf = 256 << 10

// SocketConn is implemented by a DeliverFunc's connection that wraps a
// socket only to observe what moves through it (the data plane counts the
// bytes and stamps activity). The server then reads and writes Socket() (a
// *net.TCPConn or *net.UnixConn) itself: on Linux with large reads that
// hold no buffer while the socket is idle, and with writes straight from the
// HTTP/2 read loop. It reports every read to SocketRead and every such
// write to SocketWritten; CloseWrite and Close still go through the wrapper,
// and so do writes that have to wait for the socket.
type SocketConn interface {
	net.Conn
	// Socket returns the wrapped socket.
	Socket() net.Conn
	// SocketRead is called with the byte count of each read from Socket.
	SocketRead(n int)
	// SocketWritten is called with the byte count of each write the
	// server made to Socket directly.
	SocketWritten(n int)
}

// Abortable is implemented by a DeliverFunc's connection that its owner
// may abort (the data plane's idle timeout, the pod closing). The Server
// gives it, once the stream is delivered, the function that resets the
// stream (RST_STREAM INTERNAL_ERROR) and wakes every goroutine of the
// stream, including one waiting for the client's flow-control window,
// which closing the socket alone would not wake.
type Abortable interface {
	// OnAbort sets the function the connection's abort calls.
	OnAbort(f func())
}

// ReadObserver is implemented by a DeliverFunc's connection that wants to
// know how the Server's reading of it (the response direction) ended: nil
// at EOF (the upstream finished first or after the client), the error
// otherwise (a reset, a close under the copy). The Server calls ReadDone
// once, before it ends the stream.
type ReadObserver interface {
	ReadDone(err error)
}

// Copy buffers: an idle tunnel holds only a small buffer per direction; a
// busy one borrows a large pooled buffer once a read fills the small one,
// and gives it back when the flow slows to a trickle (a read shorter than
// the small buffer), so bulk transfers are not cut into small writes. Every
// buffer has room for an HTTP/2 frame header in front of what is read.
const (
	smallBuf = 2 << 10
	largeBuf = 32 << 10
)

var largeBufs = sync.Pool{New: func() any { b := make([]byte, frameHeaderLen+largeBuf); return &b }}

// StreamWriter is implemented by a Copy destination that wraps a Stream
// only to observe what is written to it (the data plane counts the bytes
// and stamps activity). Copy then writes to HBONEStream() itself, framing
// what it reads in place, and reports every write to StreamWritten.
type StreamWriter interface {
	io.Writer
	// HBONEStream returns the wrapped stream; nil when it wraps none.
	HBONEStream() *Stream
	// StreamWritten is called with the byte count of each write Copy made
	// to the stream directly.
	StreamWritten(n int)
}

// Copy copies src to dst until src's EOF (nil) or an error: a
// *net.TCPConn or *net.UnixConn src (or a SocketConn over one) is read, on
// Linux, in reads of up to 256 KiB into a pooled buffer taken only while
// data is there, so an idle copy holds no buffer; any other src through a
// 2 KiB buffer that grows to 32 KiB while busy. Into a Stream (or a
// StreamWriter over one) every read is sent as it lies in the buffer: the
// DATA frame headers are written into it, no copy, one TLS write per frame.
func Copy(dst io.Writer, src io.Reader) error {
	st, _ := dst.(*Stream)
	var wrote func(int)
	if sw, ok := dst.(StreamWriter); ok {
		if st = sw.HBONEStream(); st != nil {
			wrote = sw.StreamWritten
		}
	}
	if st != nil {
		return readChunks(src, frameHeaderLen, st, func(b []byte) error { return st.writeTaken(b, wrote) })
	}
	return readChunks(src, 0, nil, func(b []byte) error {
		_, err := dst.Write(b)
		return err
	})
}

// sendGate is what a copy into an HTTP/2 stream reads through: the send
// windows and the connection's send buffers. A socket is read only for
// what take gave, so a stream whose peer grants no window holds no buffer.
type sendGate interface {
	// wait blocks, holding no buffer, until take may give something, or
	// fails when the stream can send no more.
	wait() error
	// take reserves up to limit bytes of send window and one of the
	// connection's send buffers; 0 when none is free now.
	take(limit int) int
	// back returns n reserved bytes that were not sent and the buffer.
	back(n int)
}

// readChunks reads src until its EOF (nil) or an error and calls sink with
// each chunk read, preceded by head bytes of room (b[:head] is free for the
// caller's use, b[head:] was read). A socket src is read by copyFromSocket
// (Linux): large reads, no buffer held while idle. With a gate, every chunk
// passed to sink is within what gate.take gave.
func readChunks(src io.Reader, head int, gate sendGate, sink func(b []byte) error) error {
	if done, err := copyFromSocket(src, head, gate, sink); done {
		return err
	}
	if gate != nil {
		inner := sink
		sink = func(b []byte) error { return sendGated(gate, head, b, inner) }
	}
	var small [frameHeaderLen + smallBuf]byte
	buf := small[frameHeaderLen-head:]
	var large *[]byte
	defer func() {
		if large != nil {
			largeBufs.Put(large)
		}
	}()
	for {
		n, err := src.Read(buf[head:])
		if n > 0 {
			if werr := sink(buf[:head+n]); werr != nil {
				return werr
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		switch {
		case n == len(buf)-head && large == nil:
			large = largeBufs.Get().(*[]byte)
			buf = (*large)[frameHeaderLen-head:]
		case n < smallBuf && large != nil:
			largeBufs.Put(large)
			large = nil
			buf = small[frameHeaderLen-head:]
		}
	}
}

// sendGated passes b[head:] to sink in pieces gate gives, each preceded by
// head bytes of room (over the tail of the piece sent before it).
func sendGated(gate sendGate, head int, b []byte, sink func([]byte) error) error {
	for off, end := 0, len(b)-head; off < end; {
		if err := gate.wait(); err != nil {
			return err
		}
		m := gate.take(end - off)
		if m == 0 {
			continue
		}
		err := sink(b[off : off+head+m])
		gate.back(0)
		if err != nil {
			return err
		}
		off += m
	}
	return nil
}

// readConn reads what c has into (*buf)[frameHeaderLen:] of a pooled
// buffer through c.Read (the buffer is held while Read waits); io.EOF at
// the end.
func readConn(c net.Conn) (*[]byte, int, error) {
	buf := sockBufs.Get().(*[]byte)
	n, err := c.Read((*buf)[frameHeaderLen:])
	if n > 0 {
		return buf, n, nil
	}
	sockBufs.Put(buf)
	if err == nil {
		err = io.ErrNoProgress
	}
	return nil, 0, err
}
