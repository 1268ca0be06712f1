package preflight

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
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

// TestMain: this test binary started by ExecCloser (CloserEnv set) is a
// closer; closerproc's init runs it and exits before TestMain.
func TestMain(m *testing.M) { harness.Main(m) }

// openSockets returns a Conn on lo in a fresh netns with its ARP and IPv6
// packet sockets open, and their identities ("socket:[inode]").
func openSockets(t *testing.T, cl Closer) (*Conn, []string) {
	t.Helper()
	n := harness.NewNS(t, "closer")
	var c *Conn
	n.MustDo(t, func() error {
		if err := harness.SetUp("lo"); err != nil {
			return err
		}
		lo, err := net.InterfaceByName("lo")
		if err != nil {
			return err
		}
		c = OpenWithCloser(lo, cl)
		for _, v4 := range []bool{true, false} {
			if _, err := c.sock(v4); err != nil {
				return err
			}
		}
		return nil
	})
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

// TestExecCloserTakesSockets: Close hands both sockets to a closer process
// (this test binary, started early) and keeps no descriptor of them; the
// closer holds them until the plugin's end of the pair closes, then exits,
// and nothing holds them.
func TestExecCloserTakesSockets(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cl := &ExecCloser{Path: self}
	t.Cleanup(func() { _ = cl.Close() })
	cl.Start() // as ADD does, before the pre-flight
	c, ids := openSockets(t, cl)
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if c.arp != nil || c.ip6 != nil {
		t.Error("Close left sockets on the Conn")
	}
	// The sockets are in flight until the closer receives them.
	var h []int
	for range 1000 {
		if h = holders(t, ids); len(h) > 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if len(h) != 1 || h[0] == os.Getpid() {
		t.Fatalf("sockets %v held by %v, want one closer process", ids, h)
	}
	pid := h[0]
	env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		t.Fatal(err)
	}
	if string(env) != CloserEnv+"=1\x00" {
		t.Errorf("closer environment = %q, want only %s=1", env, CloserEnv)
	}
	for fd := range 3 {
		if target := fdTarget(t, pid, fd); target != "/dev/null" {
			t.Errorf("closer fd %d = %q, want /dev/null (a runtime waits for the plugin's stdout to close)", fd, target)
		}
	}
	if sid, err := unix.Getsid(pid); err != nil || sid != pid {
		t.Errorf("closer session = %d, %v; want its own (%d)", sid, err, pid)
	}
	// The plugin's exit closes its end of the pair; Close does the same
	// here. The closer then exits (bounded by MaxCloserLife) and releases
	// the sockets.
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
		t.Fatalf("wait for closer %d: %v", pid, err)
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
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
