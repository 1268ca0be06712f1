package dataplane

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// TestBindTransparentAvoidsTakenFourTuples: in a pod netns whose ephemeral
// range is two ports, the app holds a connection from the client's address
// and one of those ports (made from another netns, so the kernel's own bind
// check does not see it). A source-preserving delivery to the app never
// takes that port (without the sock_diag check it would every time: bind(2)
// prefers odd ports), and with both ports taken it gives up with EADDRINUSE
// (the caller then delivers from the pod's address).
func TestBindTransparentAvoidsTakenFourTuples(t *testing.T) {
	pod, client := harness.NewNS(t, "pod"), harness.NewNS(t, "cli")
	harness.Veth(t, pod, "eth0", client, "eth0")
	harness.AddAddr(t, pod, "eth0", "10.99.0.2/24")
	harness.AddAddr(t, client, "eth0", "10.99.0.1/24")
	pod.MustDo(t, func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_local_port_range", []byte("40000 40001"), 0o644)
	})
	app := netip.MustParseAddrPort("10.99.0.2:8080")
	from := netip.MustParseAddrPort("10.99.0.1:0")
	var ln net.Listener
	pod.MustDo(t, func() error {
		var err error
		ln, err = net.Listen("tcp", app.String())
		return err
	})
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	direct := func(port int) {
		t.Helper()
		client.MustDo(t, func() error {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("10.99.0.1"), Port: port}}
			c, err := d.Dial("tcp", app.String())
			if err == nil {
				t.Cleanup(func() { c.Close() })
			}
			return err
		})
		var inUse bool
		pod.MustDo(t, func() error {
			var err error
			inUse, err = socketInUse(app, netip.AddrPortFrom(from.Addr(), uint16(port)))
			return err
		})
		if !inUse {
			t.Fatalf("socketInUse(%s, 10.99.0.1:%d) = false with the app's connection open", app, port)
		}
	}
	bound := func() (uint16, error) {
		var port uint16
		err := pod.Do(func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			if err := bindTransparent(fd, from, app); err != nil {
				return err
			}
			port = boundPort(fd)
			return nil
		})
		return port, err
	}
	pod.MustDo(t, func() error {
		inUse, err := socketInUse(app, netip.MustParseAddrPort("10.99.0.1:40000"))
		if err == nil && inUse {
			return errors.New("socketInUse reports the app's listener as a connection")
		}
		return err
	})
	// bind(2) with port 0 prefers odd ports: the kernel alone would take
	// 40001 every time.
	direct(40001)
	for range 20 {
		port, err := bound()
		if err != nil {
			t.Fatal(err)
		}
		if port != 40000 {
			t.Fatalf("delivery bound to 10.99.0.1:%d, want 40000 (40001 is the app's connection from the client)", port)
		}
	}
	direct(40000)
	if _, err := bound(); !errors.Is(err, unix.EADDRINUSE) {
		t.Fatalf("bind with every port taken = %v, want EADDRINUSE", err)
	}
}
