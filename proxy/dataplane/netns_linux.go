package dataplane

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// netNS is a pod network namespace held open by fd.
type netNS struct {
	path string
	f    *os.File
	fd   int // f's descriptor, valid until close
	dev  uint64
	ino  uint64
	home int // the process's own netns fd, to return to

	// mu is held (R) while a thread enters the namespace through fd and
	// (W) by close, so a setns never races the close (the number could
	// name another file by then).
	mu     sync.RWMutex
	closed bool
}

// errNetNSClosed fails a do after close: the pod is gone.
var errNetNSClosed = errors.New("netns is closed: its pod was removed")

func openNetNS(path string, home int) (*netNS, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("failed to open netns %q: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("failed to stat netns %q: %w", path, err)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil || fs.Type != unix.NSFS_MAGIC {
		f.Close()
		return nil, fmt.Errorf("failed to open netns %q: not a namespace file (nsfs)", path)
	}
	return &netNS{path: path, f: f, fd: int(f.Fd()), dev: st.Dev, ino: st.Ino, home: home}, nil
}

// gone reports whether the path no longer names the namespace that was
// opened (removed, unmounted, or replaced by another one).
func (n *netNS) gone() bool {
	var st unix.Stat_t
	if err := unix.Stat(n.path, &st); err != nil {
		return errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR)
	}
	return st.Dev != n.dev || st.Ino != n.ino
}

// close releases the namespace; a do after it fails with errNetNSClosed.
func (n *netNS) close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil
	}
	n.closed = true
	return n.f.Close()
}

// enter switches the calling thread into the namespace.
func (n *netNS) enter() error {
	n.mu.RLock()
	defer n.mu.RUnlock()
	if n.closed {
		return fmt.Errorf("failed to enter netns %q: %w", n.path, errNetNSClosed)
	}
	if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("failed to enter netns %q: %w", n.path, err)
	}
	return nil
}

// do runs fn on a fresh goroutine whose OS thread is locked and switched
// into the namespace, then switched back. If switching back fails the thread
// stays locked and the runtime discards it when that goroutine ends, so no
// other goroutine ever runs in the pod's namespace.
func (n *netNS) do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := n.enter(); err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		err := fn()
		if serr := unix.Setns(n.home, unix.CLONE_NEWNET); serr != nil {
			errc <- errors.Join(err, fmt.Errorf("failed to return from netns %q: %w", n.path, serr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// openHome opens the network namespace of the calling goroutine's thread:
// the namespace the proxy's goroutines run in. /proc/self/ns/net would name
// the main thread's, which need not be the same (a thread parked in another
// namespace by a library is never reused, but the main thread can be one).
func openHome() (int, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	fd, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("failed to open own netns: %w", err)
	}
	return fd, nil
}
