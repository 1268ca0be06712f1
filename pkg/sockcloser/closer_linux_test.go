package sockcloser

import (
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser/sockclosertest"
)

// testName is the closers' name in these tests.
const testName = "sockcloser-test-closer"

func requireSupported(t *testing.T) {
	t.Helper()
	if !Supported() {
		t.Fatalf("no closer image for %s: add one to closerArchs", runtime.GOARCH)
	}
}

// pipe returns the read end of a pipe whose write end is closed: a
// descriptor with an identity ("pipe:[inode]") to follow across processes.
func pipe(t *testing.T) *os.File {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	_ = w.Close()
	return r
}

// closerPID waits for cl's closer to be started and returns its pid.
func closerPID(t *testing.T, cl *ExecCloser) int {
	t.Helper()
	pid, err := cl.Started()
	if err != nil {
		t.Fatalf("closer not started: %v", err)
	}
	return pid
}

// TestExecCloser: the closer runs under its Name (command line), in its own
// session, with an empty environment, its stdio on /dev/null, its end of
// the pair on descriptor 3 and what it was sent, nothing else (not a
// descriptor its parent leaked to it); it exits 0 when the sender's end
// closes, and Close is idempotent.
func TestExecCloser(t *testing.T) {
	requireSupported(t)
	// A descriptor without close-on-exec, as a runtime may leak to a plugin.
	leaked, err := unix.Open(os.DevNull, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(leaked) })
	cl := &ExecCloser{Name: testName}
	t.Cleanup(func() { _ = cl.Close() })
	cl.Start()
	r := pipe(t)
	ids := []string{sockclosertest.Target(t, os.Getpid(), int(r.Fd()))}
	err = cl.Take([]*os.File{r})
	_ = r.Close()
	if err != nil {
		t.Fatalf("Take: %v", err)
	}
	pid := closerPID(t, cl)
	sockclosertest.CheckCloser(t, pid, testName, ids)
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if err := cl.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if ws := sockclosertest.Reap(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
		t.Errorf("closer ended with %v, want exit 0", ws)
	}
}

// TestExecCloserFails: a closer without a name is not started, and Take
// says why (the caller then closes its sockets itself).
func TestExecCloserFails(t *testing.T) {
	cl := &ExecCloser{}
	if pid, err := cl.Started(); err == nil || pid != 0 {
		t.Errorf("Started = %d, %v; want an error", pid, err)
	}
	r := pipe(t)
	defer r.Close()
	if err := cl.Take([]*os.File{r}); err == nil {
		t.Error("Take without a closer succeeded")
	}
	if err := cl.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

// TestExecCloserWait: Wait returns at once for a closer never started (a
// plugin that handed nothing over does not start one); for a started one
// it returns once the start is over, and a descriptor sent before it is
// held by the closer.
func TestExecCloserWait(t *testing.T) {
	requireSupported(t)
	idle := &ExecCloser{Name: testName}
	if err := idle.Wait(); err != nil {
		t.Fatalf("Wait of a closer never started: %v", err)
	}
	if err := idle.Close(); err != nil {
		t.Fatal(err)
	}
	cl := &ExecCloser{Name: testName}
	t.Cleanup(func() { _ = cl.Close() })
	cl.Start()
	r := pipe(t)
	ids := []string{sockclosertest.Target(t, os.Getpid(), int(r.Fd()))}
	err := cl.Take([]*os.File{r})
	_ = r.Close()
	if err != nil {
		t.Fatalf("Take: %v", err)
	}
	if err := cl.Wait(); err != nil {
		t.Fatalf("Wait: %v", err)
	}
	pid := closerPID(t, cl)
	sockclosertest.WaitHeld(t, pid, ids)
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if ws := sockclosertest.Reap(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
		t.Errorf("closer ended with %v, want exit 0", ws)
	}
}

// TestDup: Dup returns a close-on-exec duplicate of the same open file.
func TestDup(t *testing.T) {
	r := pipe(t)
	defer r.Close()
	rc, err := r.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	d, err := Dup(rc, "pipe")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Fd() == r.Fd() || sockclosertest.Target(t, os.Getpid(), int(d.Fd())) != sockclosertest.Target(t, os.Getpid(), int(r.Fd())) || d.Name() != "pipe" {
		t.Errorf("Dup = fd %d (%s) of %q, want another descriptor of %q", d.Fd(), d.Name(), sockclosertest.Target(t, os.Getpid(), int(d.Fd())), sockclosertest.Target(t, os.Getpid(), int(r.Fd())))
	}
	flags, err := unix.FcntlInt(d.Fd(), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Errorf("duplicate flags %#x, %v; want close-on-exec", flags, err)
	}
}

// TestCloserHolds: the closer keeps every descriptor it is sent, over one
// message or several, until EOF on the pair (then exits 0) or until its life
// is over (then SIGALRM ends it), whichever comes first.
func TestCloserHolds(t *testing.T) {
	requireSupported(t)
	for _, tt := range []struct {
		name     string
		messages []int // descriptors per Take
		eof      bool  // the plugin's end closes (else life ends the hold)
	}{
		{name: "EOF", eof: true},
		{name: "descriptors then EOF", messages: []int{2}, eof: true},
		{name: "several messages then EOF", messages: []int{1, 3, 2}, eof: true},
		{name: "life", messages: []int{1}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cl := &ExecCloser{Name: testName, Life: time.Second}
			t.Cleanup(func() { _ = cl.Close() })
			cl.Start()
			var ids []string
			for _, n := range tt.messages {
				var files []*os.File
				for range n {
					r := pipe(t)
					files = append(files, r)
					ids = append(ids, sockclosertest.Target(t, os.Getpid(), int(r.Fd())))
				}
				err := cl.Take(files)
				for _, f := range files {
					_ = f.Close()
				}
				if err != nil {
					t.Fatalf("Take: %v", err)
				}
			}
			pid := closerPID(t, cl)
			sockclosertest.WaitHeld(t, pid, ids)
			if !tt.eof {
				// The pair stays open: only the closer's life ends it.
				if ws := sockclosertest.Reap(t, pid); !ws.Signaled() || ws.Signal() != syscall.SIGALRM {
					t.Errorf("closer ended with %v, want SIGALRM", ws)
				}
				return
			}
			if err := cl.Close(); err != nil {
				t.Fatal(err)
			}
			if ws := sockclosertest.Reap(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
				t.Errorf("closer ended with %v, want exit 0", ws)
			}
		})
	}
}
