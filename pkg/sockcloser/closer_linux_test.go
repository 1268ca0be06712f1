package sockcloser

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

func fdTarget(t *testing.T, pid, fd int) string {
	t.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// fdTargets returns what each descriptor of process pid is open on.
func fdTargets(t *testing.T, pid int) map[int]string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]string{}
	for _, d := range fds {
		fd, err := strconv.Atoi(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		if l, err := os.Readlink(filepath.Join(dir, d.Name())); err == nil {
			out[fd] = l
		}
	}
	return out
}

// waitHeld waits until process pid holds every one of ids (in flight
// until the closer receives them), and returns its descriptors.
func waitHeld(t *testing.T, pid int, ids []string) map[int]string {
	t.Helper()
	for {
		fds := fdTargets(t, pid)
		held := 0
		for _, l := range fds {
			if slices.Contains(ids, l) {
				held++
			}
		}
		if held == len(ids) {
			return fds
		}
		time.Sleep(5 * time.Millisecond) // the test's deadline bounds the wait
	}
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

// waitExit reaps the closer (a child of the test until it exits).
func waitExit(t *testing.T, pid int) syscall.WaitStatus {
	t.Helper()
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
		t.Fatalf("wait for closer %d: %v", pid, err)
	}
	return ws
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
	ids := []string{fdTarget(t, os.Getpid(), int(r.Fd()))}
	err = cl.Take([]*os.File{r})
	_ = r.Close()
	if err != nil {
		t.Fatalf("Take: %v", err)
	}
	pid := closerPID(t, cl)
	fds := waitHeld(t, pid, ids)
	for fd, l := range fds {
		switch {
		case fd < closerFD && l == os.DevNull:
		case fd == closerFD && strings.HasPrefix(l, "socket:"):
		case fd > closerFD && slices.Contains(ids, l):
		default:
			t.Errorf("closer fd %d = %q; want stdio on /dev/null, the pair on %d, the pipe", fd, l, closerFD)
		}
	}
	if len(fds) != closerFD+1+len(ids) {
		t.Errorf("closer descriptors %v, want %d", fds, closerFD+1+len(ids))
	}
	if env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err != nil || len(env) != 0 {
		t.Errorf("closer environment = %q, %v; want empty", env, err)
	}
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || string(cmd) != testName+"\x00" {
		t.Errorf("closer command line = %q, %v; want %s", cmd, err, testName)
	}
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || !strings.Contains(exe, "memfd:"+testName) {
		t.Errorf("closer executable = %q, %v; want the memfd %s", exe, err, testName)
	}
	if sid, err := unix.Getsid(pid); err != nil || sid != pid {
		t.Errorf("closer session = %d, %v; want its own (%d)", sid, err, pid)
	}
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if err := cl.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if ws := waitExit(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
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
	if d.Fd() == r.Fd() || fdTarget(t, os.Getpid(), int(d.Fd())) != fdTarget(t, os.Getpid(), int(r.Fd())) || d.Name() != "pipe" {
		t.Errorf("Dup = fd %d (%s) of %q, want another descriptor of %q", d.Fd(), d.Name(), fdTarget(t, os.Getpid(), int(d.Fd())), fdTarget(t, os.Getpid(), int(r.Fd())))
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
					ids = append(ids, fdTarget(t, os.Getpid(), int(r.Fd())))
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
			waitHeld(t, pid, ids)
			if !tt.eof {
				// The pair stays open: only the closer's life ends it.
				if ws := waitExit(t, pid); !ws.Signaled() || ws.Signal() != syscall.SIGALRM {
					t.Errorf("closer ended with %v, want SIGALRM", ws)
				}
				return
			}
			if err := cl.Close(); err != nil {
				t.Fatal(err)
			}
			if ws := waitExit(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
				t.Errorf("closer ended with %v, want exit 0", ws)
			}
		})
	}
}
