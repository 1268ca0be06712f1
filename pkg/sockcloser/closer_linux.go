package sockcloser

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MaxLife bounds a closer's wait for the plugin to exit; SIGALRM then ends
// it. Either way, the kernel closes the sockets it holds as it exits,
// paying their release there.
const MaxLife = 10 * time.Second

// closerFD is the descriptor a closer holds its end of the unix socket pair
// on (fixed in its machine code, code_linux.go).
const closerFD = 3

// imageFD is the descriptor the closer's memfd has in the child between
// fork and exec (exec'd as /proc/self/fd/4); the closer closes it first
// thing, with every descriptor above closerFD.
const imageFD = closerFD + 1

// Taker takes over duplicates of open sockets and releases them outside the
// runtime's wait (ExecCloser; a fake in tests). After Take returns nil, the
// caller's own copies can be closed at no cost: the kernel releases a
// socket only when its last descriptor is closed.
type Taker interface {
	Take(files []*os.File) error
}

// ExecCloser hands sockets to a short-lived closer process: a tiny static
// executable (closerImage, a few hundred bytes of machine code, no Go
// runtime) written to a sealed memfd and started with fork+exec, in its own
// session, with stdin, stdout and stderr on /dev/null (a runtime waits for
// the plugin's exit and for its stdout to close, never for the closer) and
// an empty environment. Start makes the unix socket pair at once and starts
// the closer on the pair's other end in the background; Take sends it the
// sockets over the pair (SCM_RIGHTS) without waiting for the closer: they
// wait in the pair, whose other end the closer gets at its fork, and the
// caller's copies can be closed at once. The closer holds them until this
// process exits (EOF on the pair, bounded by Life), then exits; the sockets
// close in its exit. The closer is reparented to init (or the runtime's
// subreaper), which reaps it. Nothing else is left behind: it lives as long
// as the plugin plus the sockets' release, at most Life. A process that
// exits before the fork has happened releases the sockets in its own exit
// (what the closer is there to avoid), so it waits for the closer (Wait)
// before it exits. On an architecture without a closer image (Supported),
// or without a name, Take fails, and the caller closes the sockets itself;
// a fork or exec that fails after Take leaves the sockets to be released
// in this process, in the background.
//
// The zero value is not ready: Name must be set. An ExecCloser is one
// closer process, for one plugin process (or, in tests, until Close).
type ExecCloser struct {
	// Name is the closer's command line (its name in ps) and the name of
	// its memfd, e.g. "eni-vlan-socket-closer".
	Name string
	// Life is the closer's longest life; MaxLife when zero (tests shorten
	// it). It is rounded up to whole seconds.
	Life time.Duration

	once sync.Once
	done chan struct{}
	// fd is this process's end of the pair (close-on-exec), set by Start;
	// -1 when the pair could not be made (err). It is closed by this
	// process's exit, or by Close.
	fd int
	// pid is the closer's process ID (tests wait for it; the plugin
	// leaves it to init).
	pid int
	err error
}

// Start makes the pair and starts the closer in the background, once; Take
// does not wait for it, Wait and Started do.
func (e *ExecCloser) Start() {
	e.once.Do(func() {
		e.done = make(chan struct{})
		img, child, err := e.prepare()
		if err != nil {
			e.fd, e.err = -1, err
			close(e.done)
			return
		}
		go func() {
			defer close(e.done)
			e.pid, e.err = e.spawn(img, child)
		}()
	})
}

// Wait waits for the closer's start, if Start was called, and returns why
// it could not start (nil if it started, or Start was never called); a
// process that handed sockets to the closer calls it before it exits.
func (e *ExecCloser) Wait() error {
	if e.done == nil {
		return nil
	}
	<-e.done
	return e.err
}

// Started waits for the closer started by Start and returns its process
// ID, or why it could not be started. A caller that must leave no process
// behind in a long-lived process (a test, a benchmark) closes the
// ExecCloser and reaps the closer (wait4 on the pid).
func (e *ExecCloser) Started() (int, error) {
	e.Start()
	<-e.done
	return e.pid, e.err
}

// prepare checks that a closer can be started here and makes the pair: it
// sets e.fd to this process's end and returns the closer's image and end.
func (e *ExecCloser) prepare() (img []byte, child int, err error) {
	if e.Name == "" {
		return nil, -1, errors.New("socket closer has no name")
	}
	life := e.Life
	if life == 0 {
		life = MaxLife
	}
	img = closerImage(runtime.GOARCH, life)
	if img == nil {
		return nil, -1, fmt.Errorf("no socket closer for %s", runtime.GOARCH)
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, -1, fmt.Errorf("failed to create closer socket pair: %w", err)
	}
	e.fd = pair[0]
	return img, pair[1], nil
}

// spawn starts the closer with img on the pair's end child, which it then
// closes here.
func (e *ExecCloser) spawn(img []byte, child int) (pid int, err error) {
	defer func() { _ = unix.Close(child) }()
	mfd, err := memfdExecutable(e.Name, img)
	if err != nil {
		return 0, err
	}
	defer func() { _ = unix.Close(mfd) }()
	null, err := unix.Open(os.DevNull, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("failed to open %s for the socket closer: %w", os.DevNull, err)
	}
	defer func() { _ = unix.Close(null) }()
	// The path is resolved in the child after its descriptors are set up,
	// so the memfd is one of them, at a fixed number: the child's own
	// shuffling of descriptors (ForkExec moves its error pipe and any
	// descriptor in the way above the highest one of Files) could
	// otherwise land on the memfd's number and exec something else.
	path := "/proc/self/fd/" + strconv.Itoa(imageFD)
	pid, err = syscall.ForkExec(path, []string{e.Name}, &syscall.ProcAttr{
		Env:   []string{},
		Files: []uintptr{uintptr(null), uintptr(null), uintptr(null), closerFD: uintptr(child), imageFD: uintptr(mfd)},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return 0, fmt.Errorf("failed to start socket closer: %w", err)
	}
	return pid, nil
}

// memfdExecutable returns a close-on-exec memfd named name holding img,
// sealed against any change.
func memfdExecutable(name string, img []byte) (int, error) {
	flags := unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	// MFD_EXEC (Linux 6.3) says the memfd is meant to be executed; older
	// kernels reject the flag, and allow exec without it.
	fd, err := unix.MemfdCreate(name, flags|unix.MFD_EXEC)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.MemfdCreate(name, flags)
	}
	if err != nil {
		return -1, fmt.Errorf("failed to create the socket closer's memfd: %w", err)
	}
	n, err := unix.Write(fd, img)
	if err == nil && n != len(img) {
		err = io.ErrShortWrite
	}
	if err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("failed to write the socket closer's memfd: %w", err)
	}
	const seals = unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("failed to seal the socket closer's memfd: %w", err)
	}
	return fd, nil
}

// Take sends files to the closer (starting it first if Start was not
// called), without waiting for it to have started.
func (e *ExecCloser) Take(files []*os.File) error {
	e.Start()
	if e.fd < 0 {
		<-e.done
		return e.err
	}
	fds := make([]int, len(files))
	for i, f := range files {
		fds[i] = int(f.Fd())
	}
	// A closer whose start already failed has closed its end: EPIPE
	// (without SIGPIPE), and the caller closes the sockets itself.
	if err := unix.Sendmsg(e.fd, []byte{0}, unix.UnixRights(fds...), nil, unix.MSG_NOSIGNAL); err != nil {
		return fmt.Errorf("failed to send sockets to the closer: %w", err)
	}
	return nil
}

// Close closes this process's end of the pair, once the closer's start is
// over: the closer exits now rather than when this process exits (tests; a
// plugin just exits). Closing it again does nothing.
func (e *ExecCloser) Close() error {
	if e.done == nil {
		return nil
	}
	<-e.done
	if e.fd < 0 {
		return nil
	}
	fd := e.fd
	e.fd = -1
	return unix.Close(fd)
}

// Dup returns a close-on-exec duplicate of the descriptor behind rc, as a
// file named name, to hand to a Taker.
func Dup(rc syscall.RawConn, name string) (*os.File, error) {
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, fmt.Errorf("failed to get %s socket descriptor: %w", name, err)
	}
	if derr != nil {
		return nil, fmt.Errorf("failed to duplicate %s socket: %w", name, derr)
	}
	return os.NewFile(uintptr(nfd), name), nil
}
