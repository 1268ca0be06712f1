package preflight

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"

	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"

	"aether.io/node/enivlan/preflight/closerproc"
)

// CloserEnv marks a process started by ExecCloser (closerproc.Env): the
// closerproc package's init makes it hold the sockets it is sent until the
// plugin exits, and then exit, before the plugin's other packages are
// initialised.
const CloserEnv = closerproc.Env

// MaxCloserLife bounds a closer's wait for the plugin to exit; it then exits
// anyway. Either way, the kernel closes the sockets it holds as it exits,
// paying their RCU grace period there.
const MaxCloserLife = closerproc.MaxLife

// Closer takes over duplicates of the pre-flight's open sockets and
// releases them outside the runtime's wait (ExecCloser; a fake in tests).
// After Take returns nil, the caller's own copies can be closed at no cost:
// the kernel releases a socket (and waits for its RCU grace period) only
// when its last descriptor is closed.
type Closer interface {
	Take(files []*os.File) error
}

// ExecCloser hands sockets to a short-lived closer process: Path (this
// binary) started with CloserEnv set, in its own session, with no stdin,
// stdout or stderr of ours (a runtime waits for the plugin's exit and for
// its stdout to close, never for the closer). Start starts it early, in the
// background, so that starting it overlaps the ADD's other steps; Take
// sends it the sockets over a unix socket pair (SCM_RIGHTS). The closer
// holds them until this process exits (EOF on the pair, bounded by
// MaxCloserLife), then exits; the sockets close in its exit. The closer is
// reparented to init (or the runtime's subreaper), which reaps it. Nothing
// else is left behind: it lives as long as the plugin plus one grace
// period, at most MaxCloserLife.
type ExecCloser struct {
	// Path is the binary to start; "/proc/self/exe" when empty.
	Path string

	once sync.Once
	done chan struct{}
	// fd is this process's end of the pair (close-on-exec), -1 when the
	// closer could not be started (err). It is closed by this process's
	// exit, or by Close.
	fd  int
	err error
}

// Start starts the closer in the background, once; Take waits for it.
func (e *ExecCloser) Start() {
	e.once.Do(func() {
		e.done = make(chan struct{})
		go func() {
			defer close(e.done)
			e.fd, e.err = e.spawn()
		}()
	})
}

func (e *ExecCloser) spawn() (int, error) {
	path := e.Path
	if path == "" {
		path = "/proc/self/exe"
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("failed to create closer socket pair: %w", err)
	}
	child := os.NewFile(uintptr(pair[1]), "closer")
	cmd := exec.Command(path)
	cmd.Env = []string{CloserEnv + "=1"}
	cmd.ExtraFiles = []*os.File{child} // descriptor 3 in the child: closerproc.FD
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	_ = child.Close()
	if err != nil {
		_ = unix.Close(pair[0])
		return -1, fmt.Errorf("failed to start socket closer %q: %w", path, err)
	}
	return pair[0], cmd.Process.Release()
}

// Take sends files to the closer (starting it first if Start was not
// called).
func (e *ExecCloser) Take(files []*os.File) error {
	e.Start()
	<-e.done
	if e.err != nil {
		return e.err
	}
	fds := make([]int, len(files))
	for i, f := range files {
		fds[i] = int(f.Fd())
	}
	if err := unix.Sendmsg(e.fd, []byte{0}, unix.UnixRights(fds...), nil, 0); err != nil {
		return fmt.Errorf("failed to send sockets to the closer: %w", err)
	}
	return nil
}

// Close closes this process's end of the pair: the closer exits now rather
// than when this process exits (tests; a plugin just exits).
func (e *ExecCloser) Close() error {
	if e.done == nil {
		return nil
	}
	<-e.done
	if e.err != nil {
		return nil
	}
	return unix.Close(e.fd)
}

// handOff gives duplicates of c's open sockets to cl and closes c's own
// copies (no grace period: cl's process still holds them).
func (c *Conn) handOff(cl Closer) error {
	var files []*os.File
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	for _, pc := range []*packet.Conn{c.arp, c.ip6} {
		if pc == nil {
			continue
		}
		f, err := dupFile(pc)
		if err != nil {
			return err
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		return nil
	}
	if err := cl.Take(files); err != nil {
		return err
	}
	return c.closeLocal()
}

// dupFile returns a close-on-exec duplicate of pc's descriptor.
func dupFile(pc *packet.Conn) (*os.File, error) {
	rc, err := pc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("failed to get packet socket descriptor: %w", err)
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, fmt.Errorf("failed to get packet socket descriptor: %w", err)
	}
	if derr != nil {
		return nil, fmt.Errorf("failed to duplicate packet socket: %w", derr)
	}
	return os.NewFile(uintptr(nfd), "packet"), nil
}

// closeLocal closes c's sockets in this process.
func (c *Conn) closeLocal() error {
	var errs []error
	if c.arp != nil {
		errs = append(errs, c.arp.Close())
		c.arp = nil
	}
	if c.ip6 != nil {
		errs = append(errs, c.ip6.Close())
		c.ip6 = nil
	}
	return errors.Join(errs...)
}
