package hbone

import (
	"errors"
	"io"
	"net"
	"sync"
)

// SocketConn is implemented by a DeliverFunc's connection that wraps a
// socket only to observe what is read from it (the data plane counts the
// bytes and stamps activity). The server then reads Socket() (a
// *net.TCPConn or *net.UnixConn) itself, on Linux with large reads that
// hold no buffer while the socket is idle, and calls SocketRead with the
// size of every read; writes and Close still go through the wrapper.
type SocketConn interface {
	net.Conn
	// Socket returns the wrapped socket.
	Socket() net.Conn
	// SocketRead is called with the byte count of each read from Socket.
	SocketRead(n int)
}

// Copy buffers: an idle tunnel holds only a small buffer per direction; a
// busy one borrows a large pooled buffer once a read fills the small one,
// and gives it back when the flow slows to a trickle (a read shorter than
// the small buffer), so bulk transfers are not cut into small writes.
const (
	smallBuf = 2 << 10
	largeBuf = 32 << 10
)

var largeBufs = sync.Pool{New: func() any { b := make([]byte, largeBuf); return &b }}

// Copy copies src to dst until src's EOF (nil) or an error, as the server
// copies an upstream into a stream: a *net.TCPConn or *net.UnixConn src (or
// a SocketConn over one) is read, on Linux, in reads of up to 256 KiB into a
// pooled buffer taken only while data is there, so an idle copy holds no
// buffer; any other src through a 2 KiB buffer that grows to 32 KiB while
// busy. Copy into a Stream with it: net/http's request writer takes each
// Write frame by frame with one goroutine hand-off per Write, so large
// writes cost less per byte than io.Copy's 32 KiB ones.
func Copy(dst io.Writer, src io.Reader) error { return copyAdaptive(dst, src, nil) }

// copyAdaptive copies src to dst until src's EOF (nil) or an error, calling
// flush after every write when it is not nil. A socket src is read by
// copyFromSocket (Linux): large reads, no buffer held while idle.
func copyAdaptive(dst io.Writer, src io.Reader, flush func() error) error {
	if done, err := copyFromSocket(dst, src, flush); done {
		return err
	}
	var small [smallBuf]byte
	buf := small[:]
	var large *[]byte
	defer func() {
		if large != nil {
			largeBufs.Put(large)
		}
	}()
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return werr
			}
			if flush != nil {
				if ferr := flush(); ferr != nil {
					return ferr
				}
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		switch {
		case n == len(buf) && large == nil:
			large = largeBufs.Get().(*[]byte)
			buf = *large
		case n < smallBuf && large != nil:
			largeBufs.Put(large)
			large = nil
			buf = small[:]
		}
	}
}
