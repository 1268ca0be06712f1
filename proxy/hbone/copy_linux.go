package hbone

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
)

// sockBuf is the read size of copies from a socket (the upstream → client
// direction of the server): a read fills up to this much, net/http sends it
// as frames of up to the client's SETTINGS_MAX_FRAME_SIZE
// (DefaultDialerMaxFrameSize for our Dialer).
const sockBuf = 256 << 10

var sockBufs = sync.Pool{New: func() any { b := make([]byte, sockBuf); return &b }}

// copyFromSocket copies as copyAdaptive does when src is a *net.TCPConn or
// *net.UnixConn, or a SocketConn over one (exactly: any other wrapper keeps
// its Read), and reports whether it did. It reads with the socket's RawConn and
// borrows the pooled buffer only for the read(2) that finds data: while
// the socket is idle (EAGAIN, waiting in the poller) no buffer is held, so
// the read size costs an idle tunnel nothing.
func copyFromSocket(dst io.Writer, src io.Reader, flush func() error) (bool, error) {
	observe := func(int) {}
	if c, ok := src.(SocketConn); ok {
		src, observe = c.Socket(), c.SocketRead
	}
	var sc syscall.Conn
	switch c := src.(type) {
	case *net.TCPConn:
		sc = c
	case *net.UnixConn:
		sc = c
	default:
		return false, nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false, nil //nolint:nilerr // not a usable socket: the caller copies through Read
	}
	for {
		var (
			buf  *[]byte
			n    int
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			if buf == nil {
				buf = sockBufs.Get().(*[]byte)
			}
			for {
				n, rerr = syscall.Read(int(fd), *buf)
				if !errors.Is(rerr, syscall.EINTR) {
					break
				}
			}
			if errors.Is(rerr, syscall.EAGAIN) {
				sockBufs.Put(buf)
				buf = nil
				return false // wait for readability without a buffer
			}
			return true
		})
		if err == nil && rerr != nil {
			err = rerr
		}
		if err == nil && n > 0 {
			observe(n)
			_, err = dst.Write((*buf)[:n])
			if err == nil && flush != nil {
				err = flush()
			}
		}
		if buf != nil {
			sockBufs.Put(buf)
		}
		switch {
		case err != nil:
			return true, err
		case n <= 0:
			return true, nil // EOF
		}
	}
}
