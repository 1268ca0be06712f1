package preflight

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"
)

// CloserEnv marks a process started by ExecCloser: RunCloserFromEnv, called
// first thing in main, makes it wait for the plugin to exit and then exit
// itself.
const CloserEnv = "ENI_VLAN_SOCKET_CLOSER"

// MaxCloserLife bounds a closer's wait for the plugin to exit; it then exits
// anyway. Either way, the kernel closes the inherited sockets as the closer
// exits, paying their RCU grace period there.
const MaxCloserLife = 10 * time.Second

// closerPipeFD is the first descriptor a closer inherits: the read end of
// a pipe whose write end only the plugin holds (EOF = the plugin exited);
// the sockets follow from fd 4.
const closerPipeFD = 3

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
// its stdout to close, never for the closer), inheriting the sockets. The
// closer waits until this process exits (EOF on a pipe only this process
// writes to, bounded by MaxCloserLife), then exits; the sockets close in
// its exit. The closer is reparented to init (or the runtime's subreaper),
// which reaps it. Nothing else is left behind: it lives as long as the
// plugin plus one grace period (8-50 ms measured), at most MaxCloserLife.
type ExecCloser struct {
	// Path is the binary to start; "/proc/self/exe" when empty.
	Path string

	mu sync.Mutex
	// hold are the pipes' write ends: never written, closed by this
	// process's exit (held here so no finalizer closes them earlier).
	hold []*os.File
}

// Take starts a closer that inherits files.
func (e *ExecCloser) Take(files []*os.File) error {
	path := e.Path
	if path == "" {
		path = "/proc/self/exe"
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("failed to create closer pipe: %w", err)
	}
	cmd := exec.Command(path)
	cmd.Env = []string{CloserEnv + "=1"}
	cmd.ExtraFiles = append([]*os.File{r}, files...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	_ = r.Close()
	if err != nil {
		_ = w.Close()
		return fmt.Errorf("failed to start socket closer %q: %w", path, err)
	}
	e.mu.Lock()
	e.hold = append(e.hold, w)
	e.mu.Unlock()
	return cmd.Process.Release()
}

// Close closes the pipes of the closers started so far: they exit now
// rather than when this process exits (tests; a plugin just exits).
func (e *ExecCloser) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var errs []error
	for _, w := range e.hold {
		errs = append(errs, w.Close())
	}
	e.hold = nil
	return errors.Join(errs...)
}

// RunCloserFromEnv is called first thing in main: when the process is a
// closer (CloserEnv set) it waits until the plugin that started it exits
// (or MaxCloserLife) and returns true, and main then exits; otherwise it
// returns false at once.
func RunCloserFromEnv() bool {
	if os.Getenv(CloserEnv) == "" {
		return false
	}
	f := os.NewFile(closerPipeFD, "closer-pipe")
	done := make(chan struct{})
	go func() {
		// EOF, or an error on a descriptor that is not our pipe: either way
		// there is nothing more to wait for.
		_, _ = io.Copy(io.Discard, f)
		close(done)
	}()
	t := time.NewTimer(MaxCloserLife)
	select {
	case <-done:
	case <-t.C:
	}
	return true
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
