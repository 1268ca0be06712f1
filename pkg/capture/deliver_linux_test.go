package capture_test

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/capture"
	"aether.io/node/test/harness"
)

// TestDeliverMarkRoutesRepliesBack: the proxy's source-preserving delivery
// (a transparent socket in the pod bound to a client address that is not
// the pod's, SO_MARK = the deliver mark) reaches the app in the pod, the app
// sees the client's address, and its replies come back to that socket over
// lo instead of leaving the pod (they would go to the gateway, which never
// answers for the client). Without the deliver mark the same connection
// does not complete: that is what the divert's ct mark and fwmark rule fix.
func TestDeliverMarkRoutesRepliesBack(t *testing.T) {
	for _, name := range []string{"redirect-all", "inbound-default"} {
		t.Run(name, func(t *testing.T) {
			pod, _ := topology(t)
			if err := (capture.Installer{}).Install(pod.Path(), capture.Build(goldenConfigs[name])); err != nil {
				t.Fatal(err)
			}
			for _, c := range []struct{ app, client string }{
				{"10.77.0.2:7100", "10.66.0.9"},
				{"[fd77::2]:7100", "fd66::9"},
			} {
				app := netip.MustParseAddrPort(c.app)
				client := netip.MustParseAddr(c.client)
				seen := serveEcho(t, pod, app)
				got, err := deliverFrom(pod, client, app, capture.DefaultDeliverMark, 5*time.Second)
				if err != nil {
					t.Fatalf("delivery from %s to %s with the deliver mark: %v", client, app, err)
				}
				if got != "hello" {
					t.Fatalf("delivery from %s to %s: answer %q", client, app, got)
				}
				if src := <-seen; src != client {
					t.Fatalf("app %s saw the connection from %s, want the client %s", app, src, client)
				}
				// No deliver mark: the app's SYN-ACK leaves the pod.
				if _, err := deliverFrom(pod, client, app, 0, 2*time.Second); err == nil {
					t.Fatalf("delivery from %s to %s without the deliver mark completed: the control case is wrong", client, app)
				}
			}
		})
	}
}

// serveEcho listens on addr inside n, and for each connection reports its
// source address on the returned channel and answers the line it reads.
func serveEcho(t *testing.T, n *harness.NS, addr netip.AddrPort) <-chan netip.Addr {
	t.Helper()
	var l net.Listener
	n.MustDo(t, func() error {
		var err error
		l, err = net.Listen("tcp", addr.String())
		return err
	})
	t.Cleanup(func() { l.Close() })
	seen := make(chan netip.Addr, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			seen <- c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
			line, err := bufio.NewReader(c).ReadString('\n')
			if err == nil {
				_, _ = c.Write([]byte(line))
			}
			c.Close()
		}
	}()
	return seen
}

// deliverFrom connects from inside n to app with a transparent socket bound
// to src (port chosen by the kernel) carrying SO_MARK mark, sends a line and
// returns the answer.
func deliverFrom(n *harness.NS, src netip.Addr, app netip.AddrPort, mark uint32, timeout time.Duration) (string, error) {
	d := net.Dialer{
		Timeout:   timeout,
		LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0)),
		Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				level, opt := unix.SOL_IP, unix.IP_TRANSPARENT
				if src.Is6() {
					level, opt = unix.SOL_IPV6, unix.IPV6_TRANSPARENT
				}
				serr = unix.SetsockoptInt(int(fd), level, opt, 1)
				if serr == nil && mark != 0 {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
				}
			})
			if err != nil {
				return err
			}
			return serr
		},
	}
	var c net.Conn
	if err := n.Do(func() error {
		var err error
		c, err = d.Dial("tcp", app.String())
		return err
	}); err != nil {
		return "", fmt.Errorf("failed to connect: %w", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("hello\n")); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	return line[:len(line)-1], nil
}
