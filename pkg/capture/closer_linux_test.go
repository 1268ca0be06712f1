package capture_test

import (
	"bytes"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/pkg/sockcloser"
	"aether.io/node/pkg/sockcloser/sockclosertest"
	"aether.io/node/test/harness"
)

// heldNetfilter returns the netfilter netlink sockets process pid holds
// ("socket:[inode]"), read through pidfd_getfd (the closer's descriptors
// cannot be opened through /proc).
func heldNetfilter(t *testing.T, pid int) []string {
	t.Helper()
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd_open %d: %v", pid, err)
	}
	defer unix.Close(pidfd)
	var out []string
	for fd, l := range sockclosertest.FDs(t, pid) {
		if !strings.HasPrefix(l, "socket:") {
			continue
		}
		dup, err := unix.PidfdGetfd(pidfd, fd, 0)
		if err != nil {
			t.Fatalf("pidfd_getfd %d/%d: %v", pid, fd, err)
		}
		dom, derr := unix.GetsockoptInt(dup, unix.SOL_SOCKET, unix.SO_DOMAIN)
		proto, perr := unix.GetsockoptInt(dup, unix.SOL_SOCKET, unix.SO_PROTOCOL)
		_ = unix.Close(dup)
		if derr == nil && perr == nil && dom == unix.AF_NETLINK && proto == unix.NETLINK_NETFILTER {
			out = append(out, l)
		}
	}
	return out
}

// waitNetfilter waits until process pid (a closer) holds a netfilter
// socket (in flight until it receives it) and returns those it holds; the
// test's deadline bounds the wait.
func waitNetfilter(t *testing.T, pid int) []string {
	t.Helper()
	for {
		if held := heldNetfilter(t, pid); len(held) > 0 {
			return held
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestCloserTakesRemovingCommits: with a Closer, only a commit that removes
// anything starts it (a retry whose divert lost an exclusion: the rewrite;
// Remove's table delete), never a fresh install, a same-divert retry or an
// insertion. After such a commit the closer holds the netfilter socket and
// this process holds no netfilter socket; when this process's end of the
// pair closes (its exit), the closer exits 0 and nothing holds the socket
// any more. The divert is the wanted one throughout.
func TestCloserTakesRemovingCommits(t *testing.T) {
	if !sockcloser.Supported() {
		t.Fatal("no socket closer for this architecture")
	}
	fewer := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22}})
	rs := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306}})
	// The divert of a first attempt with an exclusion more.
	more := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306, 5432}})
	for _, tc := range []struct {
		name string
		// prepare runs first, without a closer (nil: a fresh netns).
		prepare *capture.Ruleset
		remove  bool // Remove after the install, both with the closer
		started bool
	}{
		{name: "fresh"},
		{name: "same", prepare: &rs},
		{name: "insertion", prepare: &fewer},
		{name: "removing", prepare: &more, started: true},
		{name: "remove", remove: true, started: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := harness.NewNS(t, "closer")
			if tc.prepare != nil {
				if err := (capture.Installer{}).Install(pod.Path(), *tc.prepare); err != nil {
					t.Fatal(err)
				}
			}
			cl := capturetest.NewCloser(0)
			t.Cleanup(func() { cl.End(t) })
			inst := capture.Installer{Closer: cl}
			if err := inst.Install(pod.Path(), rs); err != nil {
				t.Fatal(err)
			}
			if err := capture.VerifyFd(int(pod.Fd()), rs); err != nil {
				t.Fatalf("Verify after install: %v", err)
			}
			if tc.remove {
				if cl.Starts != 0 {
					t.Fatalf("a fresh install started the closer")
				}
				if err := inst.Remove(pod.Path(), rs.Config); err != nil {
					t.Fatal(err)
				}
				if ok, err := inst.Present(pod.Path()); err != nil || ok {
					t.Fatalf("Present after Remove = %v, %v", ok, err)
				}
			}
			if got := cl.Starts > 0; got != tc.started {
				t.Fatalf("closer started %d times, want started %v", cl.Starts, tc.started)
			}
			if !tc.started {
				return
			}
			pid, err := cl.Started()
			if err != nil {
				t.Fatal(err)
			}
			held := waitNetfilter(t, pid)
			if len(held) != 1 {
				t.Fatalf("closer holds netfilter sockets %v, want the commit's one", held)
			}
			sockclosertest.CheckCloser(t, pid, capture.CloserName, held)
			if mine := heldNetfilter(t, os.Getpid()); len(mine) > 0 {
				t.Errorf("this process still holds netfilter sockets %v", mine)
			}
			if ws, _ := cl.End(t); !ws.Exited() || ws.ExitStatus() != 0 {
				t.Errorf("closer ended with %v, want exit 0", ws)
			}
			if h := sockclosertest.Holders(t, held[:1]); len(h) > 0 {
				t.Errorf("socket %s still held by %v after the closer exited", held[0], h)
			}
		})
	}
}

// TestCloserFallback: a closer that cannot start (here: no name) leaves a
// removing install correct, its socket closed in this process, and says
// so at DEBUG.
func TestCloserFallback(t *testing.T) {
	pod := harness.NewNS(t, "closer")
	more := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306, 5432}})
	rs := capture.Build(capture.Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306}})
	if err := (capture.Installer{}).Install(pod.Path(), more); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	inst := capture.Installer{
		Closer: &sockcloser.ExecCloser{},
		Log:    slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if err := inst.Install(pod.Path(), rs); err != nil {
		t.Fatal(err)
	}
	if err := capture.VerifyFd(int(pod.Fd()), rs); err != nil {
		t.Fatalf("Verify after install: %v", err)
	}
	if !strings.Contains(logs.String(), "level=DEBUG msg=\"netfilter socket closed in the plugin") {
		t.Errorf("no DEBUG line for the fallback in %q", logs.String())
	}
	if mine := heldNetfilter(t, os.Getpid()); len(mine) > 0 {
		t.Errorf("this process still holds netfilter sockets %v", mine)
	}
}
