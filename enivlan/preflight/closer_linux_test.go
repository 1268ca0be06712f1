package preflight

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser"
	"aether.io/node/pkg/sockcloser/sockclosertest"
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
	return sockclosertest.Target(t, os.Getpid(), int(f.Fd()))
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
	sockclosertest.CheckCloser(t, pid, CloserName, ids)
	if h := sockclosertest.Holders(t, ids); len(h) != 1 || h[0] != pid {
		t.Errorf("sockets %v held by %v, want only the closer %d", ids, h, pid)
	}
	// The plugin's exit closes its end of the pair; Close does the same
	// here. The closer then exits and releases the sockets.
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if ws := sockclosertest.Reap(t, pid); !ws.Exited() || ws.ExitStatus() != 0 {
		t.Errorf("closer ended with %v, want exit 0", ws)
	}
	if h := sockclosertest.Holders(t, ids); len(h) > 0 {
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
			if h := sockclosertest.Holders(t, ids); len(h) > 0 {
				t.Errorf("sockets still held by %v after Close", h)
			}
		})
	}
}
