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

	"aether.io/node/pkg/sockcloser"
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
func openBoth(tb testing.TB, n *harness.NS, lo *net.Interface, cl sockcloser.Taker) *Conn {
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
func openSockets(t *testing.T, cl sockcloser.Taker) (*Conn, []string) {
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
func closerPID(t *testing.T, cl *sockcloser.ExecCloser) int {
	t.Helper()
	pid, err := cl.Started()
	if err != nil {
		t.Fatalf("closer not started: %v", err)
	}
	return pid
}

// closerFD is the descriptor the closer holds its end of the pair on.
const closerFD = 3

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
	if !sockcloser.Supported() {
		t.Fatalf("no closer image for %s: add one to sockcloser", runtime.GOARCH)
	}
	// A descriptor without close-on-exec, as a runtime may leak to a plugin.
	leaked, err := unix.Open(os.DevNull, unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Close(leaked) })
	cl := NewExecCloser()
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
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || string(cmd) != CloserName+"\x00" {
		t.Errorf("closer command line = %q, %v; want %s", cmd, err, CloserName)
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
