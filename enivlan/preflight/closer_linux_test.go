package preflight

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// TestMain checks that the tests leave no namespace or link behind.
func TestMain(m *testing.M) { harness.Main(m) }

// loopback returns a fresh netns with lo up, and lo.
func loopback(tb testing.TB) (*harness.NS, *net.Interface) {
	tb.Helper()
	n := harness.NewNS(tb, "closer")
	var lo *net.Interface
	n.MustDo(tb, func() error {
		if err := harness.SetUp("lo"); err != nil {
			return err
		}
		var err error
		lo, err = net.InterfaceByName("lo")
		return err
	})
	return n, lo
}

// openBoth opens a Conn on lo in n, handing its sockets to cl, with its ARP
// and IPv6 packet sockets open.
func openBoth(tb testing.TB, n *harness.NS, lo *net.Interface, cl Closer) *Conn {
	tb.Helper()
	c := OpenWithCloser(lo, cl)
	n.MustDo(tb, func() error {
		for _, v4 := range []bool{true, false} {
			if _, err := c.sock(v4); err != nil {
				return err
			}
		}
		return nil
	})
	return c
}

// openSockets returns a Conn on lo in a fresh netns with its ARP and IPv6
// packet sockets open, and their identities ("socket:[inode]").
func openSockets(t *testing.T, cl Closer) (*Conn, []string) {
	t.Helper()
	n, lo := loopback(t)
	c := openBoth(t, n, lo, cl)
	t.Cleanup(func() { _ = c.closeParallel() })
	return c, []string{socketID(t, c.arp), socketID(t, c.ip6)}
}

func socketID(t *testing.T, pc *packet.Conn) string {
	t.Helper()
	f, err := dupFile(pc)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return fdTarget(t, os.Getpid(), int(f.Fd()))
}

func fdTarget(t *testing.T, pid, fd int) string {
	t.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// holders returns the processes with a descriptor on any of ids.
func holders(t *testing.T, ids []string) []int {
	t.Helper()
	procs, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, err := os.ReadDir(filepath.Join("/proc", p.Name(), "fd"))
		if err != nil {
			continue // gone, or a kernel thread
		}
		for _, fd := range fds {
			if l, err := os.Readlink(filepath.Join("/proc", p.Name(), "fd", fd.Name())); err == nil && slices.Contains(ids, l) {
				out = append(out, pid)
				break
			}
		}
	}
	return out
}

// TestExecCloserTakesSockets: Close hands both sockets to a closer // fdTargets returns what each descriptor of process pid is open on.
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
// until the closer receives them).
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
	cl.Start()
	<-cl.done
	if cl.err != nil {
		t.Fatalf("closer not started: %v", cl.err)
	}
	return cl.pid
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

// TestExecCloserTakesSockets: Close hands both sockets to a closer process
// (started early, as ADD does) and keeps no descriptor of them; the closer
// holds them, its stdio on /dev/null, its end of the pair and nothing else
// (not a descriptor its parent leaked to it, no environment), until the
// plugin's end of the pair closes; it then exits 0 and nothing holds them.
func TestExecCloserTakesSockets(t *testing.T) {
	if !CloserSupported() {
		t.Fatalf("no closer image for %s: add one to closerArchs", runtime.GOARCH)
	}
	// A descriptor without close-on-exec, as a runtime may leak to a plugin.
	leaked, err := unix.Open(os.DevNull, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(leaked) })
	cl := &ExecCloser{}
	t.Cleanup(func() { _ = cl.Close() })
	cl.Start() // as ADD does, before the pre-flight
	c, ids := openSockets(t, cl)
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if c.arp != nil || c.ip6 != nil {
		t.Error("Close left sockets on the Conn")
	}
	pid := closerPID(t, cl)
	fds := waitHeld(t, pid, ids)
	if h := holders(t, ids); len(h) != 1 || h[0] != pid {
		t.Errorf("sockets %v held by %v, want only the closer %d", ids, h, pid)
	}
	for fd, l := range fds {
		switch {
		case fd < closerFD && l == os.DevNull:
		case fd == closerFD && strings.HasPrefix(l, "socket:"):
		case fd > closerFD && slices.Contains(ids, l):
		default:
			t.Errorf("closer fd %d = %q; want stdio on /dev/null, the pair on %d, the sockets", fd, l, closerFD)
		}
	}
	if len(fds) != closerFD+1+len(ids) {
		t.Errorf("closer descriptors %v, want %d", fds, closerFD+1+len(ids))
	}
	if env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err != nil || len(env) != 0 {
		t.Errorf("closer environment = %q, %v; want empty", env, err)
	}
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || string(cmd) != closerArg0+"\x00" {
		t.Errorf("closer command line = %q, %v; want %s", cmd, err, closerArg0)
	}
	if sid, err := unix.Getsid(pid); err != nil || sid != pid {
		t.Errorf("closer session = %d, %v; want its own (%d)", sid, err, pid)
	}
	// The plugin's exit closes its end of the pair; Close does the same
	// here. The closer then exits and releases the sockets.
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if ws := waitExit(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
		t.Errorf("closer ended with %v, want exit 0", ws)
	}
	if h := holders(t, ids); len(h) > 0 {
		t.Errorf("sockets still held by %v after the closer exited", h)
	}
}

// TestCloserHolds: the closer keeps every descriptor it is sent, over one
// message or several, until EOF on the pair (then exits 0) or until its life
// is over (then SIGALRM ends it), whichever comes first.
func TestCloserHolds(t *testing.T) {
	if !CloserSupported() {
		t.Fatalf("no closer image for %s: add one to closerArchs", runtime.GOARCH)
	}
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
			cl := &ExecCloser{life: time.Second}
			t.Cleanup(func() { _ = cl.Close() })
			cl.Start()
			var ids []string
			for _, n := range tt.messages {
				var files []*os.File
				for range n {
					r, w, err := os.Pipe()
					if err != nil {
						t.Fatal(err)
					}
					_ = w.Close()
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

type fakeCloser struct {
	err  error
	took []string
}

func (f *fakeCloser) Take(files []*os.File) error {
	for _, fl := range files {
		if !strings.HasPrefix(fl.Name(), "packet") {
			return fmt.Errorf("unexpected file %q", fl.Name())
		}
		l, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fl.Fd()))
		if err != nil {
			return err
		}
		f.took = append(f.took, l)
	}
	return f.err
}

// TestCloseHandOff: a Closer gets duplicates of exactly the open sockets;
// when it fails, Close says so and closes the sockets here.
func TestCloseHandOff(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		wantErr bool
	}{
		{name: "taken"},
		{name: "closer fails", err: errors.New("exec failed"), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := &fakeCloser{err: tc.err}
			c, ids := openSockets(t, cl)
			err := c.Close()
			if (err != nil) != tc.wantErr || (err != nil && !strings.Contains(err.Error(), "failed to hand packet sockets to a closer")) {
				t.Fatalf("Close = %v, want error %v", err, tc.wantErr)
			}
			if !slices.Equal(cl.took, ids) {
				t.Errorf("closer took %v, want %v", cl.took, ids)
			}
			if h := holders(t, ids); len(h) > 0 {
				t.Errorf("sockets still held by %v after Close", h)
			}
		})
	}
}
