package dataplane

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// pipeSize is the capacity asked of every splice pipe (F_SETPIPE_SZ): one
// splice(2) then takes up to this much of a socket's receive queue. A
// kernel that refuses it (fs.pipe-max-size, the user's pipe-user-pages
// limits) leaves the pipe at its default size.
const pipeSize = 1 << 20

// maxIdlePipes bounds the empty pipes the pool keeps for the next busy
// connection; more are closed.
const maxIdlePipes = 64

// spliceFlags moves page references instead of copying where the kernel can
// and never blocks in the kernel: the Go netpoller waits instead.
const spliceFlags = unix.SPLICE_F_MOVE | unix.SPLICE_F_NONBLOCK

// errNoSplice reports that a splice copy cannot go on (the kernel cannot
// splice from the socket, or no pipe could be made: EMFILE) with no byte left
// in a pipe, so the caller may copy the rest through a buffer instead.
var errNoSplice = errors.New("splice not supported")

// splicePipe is one pipe and the bytes it holds.
type splicePipe struct {
	r, w     int
	size     int // capacity in bytes
	inflight int // bytes spliced in and not yet out
}

func newSplicePipe() (*splicePipe, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, os.NewSyscallError("pipe2", err)
	}
	p := &splicePipe{r: fds[0], w: fds[1]}
	size, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, pipeSize)
	if err != nil { // refused: keep the default size
		if size, err = unix.FcntlInt(uintptr(p.w), unix.F_GETPIPE_SZ, 0); err != nil {
			p.close()
			return nil, os.NewSyscallError("fcntl F_GETPIPE_SZ", err)
		}
	}
	p.size = size
	return p, nil
}

func (p *splicePipe) close() {
	_ = unix.Close(p.r)
	_ = unix.Close(p.w)
}

// pipePool holds empty pipes between uses. A copy takes one only while
// bytes are in flight and gives it back once the pipe is drained, so an
// idle connection holds no pipe.
type pipePool struct {
	// newPipe makes a pipe when none is free; nil: newSplicePipe.
	newPipe func() (*splicePipe, error)

	mu     sync.Mutex
	free   []*splicePipe
	closed bool
}

func (pp *pipePool) get() (*splicePipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	if pp.newPipe != nil {
		return pp.newPipe()
	}
	return newSplicePipe()
}

// put keeps an empty pipe for reuse; a pipe with bytes left in it (its
// copy failed) or one over the pool's bound is closed.
func (pp *pipePool) put(p *splicePipe) {
	if p.inflight == 0 {
		pp.mu.Lock()
		if !pp.closed && len(pp.free) < maxIdlePipes {
			pp.free = append(pp.free, p)
			pp.mu.Unlock()
			return
		}
		pp.mu.Unlock()
	}
	p.close()
}

// idle is the number of pipes kept in the pool.
func (pp *pipePool) idle() int {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	return len(pp.free)
}

// close closes the kept pipes; pipes put back later are closed at once.
func (pp *pipePool) close() {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	pp.closed = true
	for _, p := range pp.free {
		p.close()
	}
	pp.free = nil
}

// splice copies src to dst through a pipe of the pool until src's EOF or
// an error: splice(2) socket → pipe → socket, waiting in the Go netpoller
// (syscall.RawConn Read/Write) whenever a socket would block. Moved bytes
// are passed to add every accountChunk bytes, whenever the copy waits for
// src (the connection went idle) and at the end. It returns errNoSplice,
// with every byte it took from src delivered to dst, when it cannot go on.
func (pp *pipePool) splice(dst, src syscall.Conn, add func(int64)) (int64, error) {
	rrc, err := src.SyscallConn()
	if err != nil {
		return 0, err
	}
	wrc, err := dst.SyscallConn()
	if err != nil {
		return 0, err
	}
	var (
		p              *splicePipe
		total, pending int64
		eof            bool
		serr           error
	)
	flush := func() {
		if pending > 0 {
			add(pending)
			pending = 0
		}
	}
	defer func() {
		if p != nil {
			pp.put(p)
		}
		flush()
	}()
	// fill splices what src holds into the pipe; it waits for src only
	// with an empty pipe, which then goes back to the pool first.
	fill := func(fd uintptr) bool {
		if p == nil {
			var err error
			if p, err = pp.get(); err != nil {
				serr = fmt.Errorf("%w: %w", errNoSplice, err)
				return true
			}
		}
		for {
			n, err := unix.Splice(int(fd), nil, p.w, nil, p.size-p.inflight, spliceFlags)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				if p.inflight == 0 {
					pp.put(p)
					p = nil
				}
				flush()
				return false
			case err != nil:
				serr = os.NewSyscallError("splice", err)
				if (err == unix.EINVAL || err == unix.ENOSYS) && p.inflight == 0 {
					serr = fmt.Errorf("%w: %w", errNoSplice, serr)
				}
			case n == 0:
				eof = true
			default:
				p.inflight += int(n)
			}
			return true
		}
	}
	// drain splices the whole pipe into dst, waiting while dst is full.
	drain := func(fd uintptr) bool {
		for p.inflight > 0 {
			n, err := unix.Splice(p.r, nil, int(fd), nil, p.inflight, spliceFlags)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false
			case err != nil:
				serr = os.NewSyscallError("splice", err)
				return true
			case n == 0: // never from a non-empty pipe; do not spin on it
				serr = io.ErrShortWrite
				return true
			}
			p.inflight -= int(n)
			total += n
			pending += n
		}
		return true
	}
	for {
		if err := rrc.Read(fill); err != nil {
			return total, err
		}
		if serr != nil {
			return total, serr
		}
		if p != nil && p.inflight > 0 {
			if err := wrc.Write(drain); err != nil {
				return total, err
			}
			if serr != nil {
				return total, serr
			}
			if pending >= accountChunk {
				flush()
			}
		}
		if eof {
			return total, nil
		}
	}
}
