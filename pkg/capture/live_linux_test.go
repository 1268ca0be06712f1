package capture_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

// echoServer answers every line with the same line, in ns on addr.
func echoServer(t *testing.T, ns *harness.NS, network, addr string) {
	t.Helper()
	var l net.Listener
	ns.MustDo(t, func() error {
		var err error
		l, err = net.Listen(network, addr)
		return err
	})
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					if _, err := fmt.Fprintf(c, "%s\n", sc.Text()); err != nil {
						return
					}
				}
			}()
		}
	}()
}

// roundTrip writes line on c and reads the echo back.
func roundTrip(c net.Conn, r *bufio.Reader, line string) error {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "%s\n", line); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got, err := r.ReadString('\n')
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if got != line+"\n" {
		return fmt.Errorf("echo %q, want %q", got, line)
	}
	return nil
}

// TestLiveInstallSparesEstablished puts a divert into a "pod" that already
// has connections open (outbound TCP over IPv4 and IPv6, and one the pod's
// app accepted from outside, which the inbound redirect would take): with SpareEstablished they
// keep working, untouched, while every connection opened after the install
// is captured; removing the divert leaves the old ones working still.
// Without SpareEstablished (the divert aether-cni puts in at ADD) the same
// old connection is handed to the capture listener and breaks: the reason
// the flag exists.
func TestLiveInstallSparesEstablished(t *testing.T) {
	for _, spare := range []bool{true, false} {
		t.Run(fmt.Sprintf("spare=%v", spare), func(t *testing.T) {
			pod, remote := topology(t)
			echoServer(t, remote, "tcp4", "10.77.0.1:80")
			echoServer(t, remote, "tcp6", "[fd77::1]:80")
			echoServer(t, pod, "tcp4", "10.77.0.2:7000") // the app, reached from outside (inbound)
			type conn struct {
				c net.Conn
				r *bufio.Reader
			}
			old := map[string]conn{}
			for _, dst := range []string{"10.77.0.1:80", "[fd77::1]:80"} {
				pod.MustDo(t, func() error {
					c, err := net.Dial("tcp", dst)
					if err != nil {
						return err
					}
					old[dst] = conn{c, bufio.NewReader(c)}
					t.Cleanup(func() { _ = c.Close() })
					return nil
				})
				if err := roundTrip(old[dst].c, old[dst].r, "before"); err != nil {
					t.Fatalf("%s before the install: %v", dst, err)
				}
			}
			remote.MustDo(t, func() error {
				c, err := net.Dial("tcp", "10.77.0.2:7000")
				if err != nil {
					return err
				}
				old["inbound 10.77.0.2:7000"] = conn{c, bufio.NewReader(c)}
				t.Cleanup(func() { _ = c.Close() })
				return nil
			})
			if c := old["inbound 10.77.0.2:7000"]; roundTrip(c.c, c.r, "before") != nil {
				t.Fatal("inbound connection before the install does not work")
			}
			sink := capturetest.NewSink()
			capturetest.Listen(t, pod, sink, "capture", capture.DefaultCapturePort, true, "tcp4", "tcp6")
			cfg := capture.Config{RedirectAll: true, InboundCapture: true, SpareEstablished: spare}
			inst := capture.Installer{}
			if err := inst.Install(pod.Path(), capture.Build(cfg)); err != nil {
				t.Fatal(err)
			}
			for dst, c := range old {
				err := roundTrip(c.c, c.r, "after")
				if spare && err != nil {
					t.Errorf("%s opened before the install broke after it: %v", dst, err)
				}
				if !spare && err == nil {
					t.Errorf("%s opened before an install without SpareEstablished still works: the test shows nothing", dst)
				}
			}
			for i, dst := range []string{"10.77.0.1:80", "[fd77::1]:80"} {
				payload := fmt.Sprintf("new-%v-%d", spare, i)
				if err := capturetest.Send(pod, "tcp", netip.MustParseAddrPort(dst), payload, 0); err != nil {
					t.Fatalf("new connection to %s: %v", dst, err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				got, err := sink.Wait(ctx, payload)
				cancel()
				if err != nil || got.Listener != "capture" {
					t.Errorf("new connection to %s after the install: landed %+v (%v), want the capture listener", dst, got, err)
				}
			}
			if !spare {
				return
			}
			if err := inst.Remove(pod.Path(), cfg); err != nil {
				t.Fatal(err)
			}
			for dst, c := range old {
				if err := roundTrip(c.c, c.r, "removed"); err != nil {
					t.Errorf("%s after the divert was removed: %v", dst, err)
				}
			}
		})
	}
}

// TestLiveToggle: a pod's live divert installed and removed many times in
// a row (a label toggled quickly), sometimes installed twice, with a
// connection open from before the first install: each install verifies,
// the old connection keeps working all along, and after the last removal
// the namespace is as it was (no rule, route or table left).
func TestLiveToggle(t *testing.T) {
	pod, remote := topology(t)
	echoServer(t, remote, "tcp4", "10.77.0.1:80")
	var c net.Conn
	pod.MustDo(t, func() error {
		var err error
		c, err = net.Dial("tcp4", "10.77.0.1:80")
		return err
	})
	t.Cleanup(func() { _ = c.Close() })
	r := bufio.NewReader(c)
	if err := roundTrip(c, r, "before"); err != nil {
		t.Fatal(err)
	}
	before := nsSnapshot(t, pod)
	inst := capture.Installer{}
	rs := capture.Build(capture.Config{RedirectAll: true, InboundCapture: true, SpareEstablished: true})
	for i := range 20 {
		for range 1 + i%2 { // every other round installs twice: the same as once
			if err := inst.Install(pod.Path(), rs); err != nil {
				t.Fatalf("round %d: install: %v", i, err)
			}
		}
		if err := inst.Verify(pod.Path(), rs); err != nil {
			t.Fatalf("round %d: verify: %v", i, err)
		}
		if err := roundTrip(c, r, fmt.Sprintf("installed-%d", i)); err != nil {
			t.Fatalf("round %d: the old connection with the divert in: %v", i, err)
		}
		if err := inst.Remove(pod.Path(), rs.Config); err != nil {
			t.Fatalf("round %d: remove: %v", i, err)
		}
		if err := roundTrip(c, r, fmt.Sprintf("removed-%d", i)); err != nil {
			t.Fatalf("round %d: the old connection with the divert out: %v", i, err)
		}
	}
	if after := nsSnapshot(t, pod); after != before {
		t.Fatalf("toggling left state behind:\n--- before\n%s\n--- after\n%s", before, after)
	}
}

// TestLiveNetnsGone: a pod whose network namespace is gone (the pod ended
// while it was being enrolled) gets an error that says so, for install
// and removal alike, so the caller can tell it from a failed install.
func TestLiveNetnsGone(t *testing.T) {
	pod := harness.NewNS(t, "gone")
	path := pod.Path()
	// Gone as a pod's netns goes: its mount and path (the harness's
	// cleanup closes the handle).
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	rs := capture.Build(capture.Config{RedirectAll: true, SpareEstablished: true})
	if err := (capture.Installer{}).Install(path, rs); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Install into a removed netns = %v, want an error wrapping fs.ErrNotExist", err)
	}
	if err := (capture.Installer{}).Remove(path, rs.Config); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Remove from a removed netns = %v, want an error wrapping fs.ErrNotExist", err)
	}
}
