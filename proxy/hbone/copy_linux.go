package hbone

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
)

var sockBufs = sync.Pool{New: func() any { b := make([]byte, frameHeaderLen+sockBuf); return &b }}

// copyFromSocket reads as readChunks does when src is a *net.TCPConn or
// *net.UnixConn, or a SocketConn over one (exactly: any other wrapper keeps
// its Read), and reports whether it did. It reads with the socket's RawConn and
// borrows the pooled buffer only for the read(2) that finds data: while
// the socket is idle (EAGAIN, waiting in the poller) no buffer is held, so
// the read size costs an idle tunnel nothing. With a gate, it reads only
// what the gate gives (the send window left) and waits for the gate
// without a buffer.
func copyFromSocket(src io.Reader, head int, gate sendGate, sink func([]byte) error) (bool, error) {
	observe := func(int) {}
	if c, ok := src.(SocketConn); ok {
		src, observe = c.Socket(), c.SocketRead
	}
	rc := socketRawConn(src)
	if rc == nil {
		return false, nil // not a socket: the caller copies through Read
	}
	// The read is inline, not readRaw: this loop is where every idle
	// server stream's goroutine parks, and one more frame under it kept
	// its stack at 8 KiB instead of 4 (+4 KB per idle tunnel in
	// BenchmarkHBONEIdleTunnels).
	for {
		if gate != nil {
			if err := gate.wait(); err != nil {
				return true, err
			}
		}
		var (
			buf    *[]byte
			n, m   int
			closed bool // the gate gave nothing: wait for it again
			rerr   error
		)
		err := rc.Read(func(fd uintptr) bool {
			lim := sockBuf
			if gate != nil {
				if m = gate.take(sockBuf); m == 0 {
					closed = true
					return true
				}
				lim = m
			}
			if buf == nil {
				buf = sockBufs.Get().(*[]byte)
			}
			for {
				n, rerr = syscall.Read(int(fd), (*buf)[frameHeaderLen:frameHeaderLen+lim])
				if !errors.Is(rerr, syscall.EINTR) {
					break
				}
			}
			if errors.Is(rerr, syscall.EAGAIN) {
				sockBufs.Put(buf)
				buf = nil
				if gate != nil {
					gate.back(m)
					m = 0
				}
				return false // wait for readability without a buffer or window
			}
			return true
		})
		if closed && err == nil {
			continue
		}
		if err == nil && rerr != nil {
			err = rerr
		}
		if err == nil && n > 0 {
			observe(n)
			err = sink((*buf)[frameHeaderLen-head : frameHeaderLen+n])
		}
		if buf != nil {
			sockBufs.Put(buf)
		}
		if gate != nil && m > 0 {
			gate.back(m - max(n, 0))
		}
		switch {
		case err != nil:
			return true, err
		case n <= 0:
			return true, nil // EOF
		}
	}
}

// socketRawConn returns the RawConn of a *net.TCPConn or *net.UnixConn;
// nil for anything else.
func socketRawConn(c any) syscall.RawConn {
	var sc syscall.Conn
	switch t := c.(type) {
	case *net.TCPConn:
		sc = t
	case *net.UnixConn:
		sc = t
	default:
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// readRaw reads what the socket has, up to 256 KiB, into
// (*buf)[frameHeaderLen:] of a pooled buffer taken only for the read(2)
// that finds data (none is held while waiting in the poller); io.EOF at the
// end. The caller puts buf back.
func readRaw(rc syscall.RawConn) (*[]byte, int, error) {
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
			n, rerr = syscall.Read(int(fd), (*buf)[frameHeaderLen:])
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
	if err == nil {
		err = rerr
	}
	if err == nil && n <= 0 {
		err = io.EOF
	}
	if err != nil {
		if buf != nil {
			sockBufs.Put(buf)
		}
		return nil, 0, err
	}
	return buf, n, nil
}

// rawSocket returns the socket of up that the server writes DATA to
// without waiting (up, or the Socket of a SocketConn, when it is a
// *net.TCPConn or *net.UnixConn) and the function to report those writes
// to; nil when there is none (every write then goes through up.Write).
func rawSocket(up net.Conn) (syscall.RawConn, func(int)) {
	var wrote func(int)
	if c, ok := up.(SocketConn); ok {
		up, wrote = c.Socket(), c.SocketWritten
	}
	rc := socketRawConn(up)
	if rc == nil {
		return nil, nil
	}
	return rc, wrote
}

// tryWrite writes p to the socket without waiting and returns how much it
// took (0 when its send buffer is full).
func tryWrite(rc syscall.RawConn, p []byte) (int, error) {
	var (
		n    int
		werr error
	)
	err := rc.Write(func(fd uintptr) bool {
		for {
			n, werr = syscall.Write(int(fd), p)
			if !errors.Is(werr, syscall.EINTR) {
				return true
			}
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errors.Is(werr, syscall.EAGAIN):
		return 0, nil
	case werr != nil:
		return 0, werr
	}
	return n, nil
}

// readSocket reads what c has, up to 256 KiB, into (*buf)[frameHeaderLen:]
// of a pooled buffer taken only once the socket is readable (a
// *net.TCPConn or *net.UnixConn; any other conn through its Read); io.EOF
// at the end.
func readSocket(c net.Conn) (*[]byte, int, error) {
	if rc := socketRawConn(c); rc != nil {
		return readRaw(rc)
	}
	return readConn(c)
}
