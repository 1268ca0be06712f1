package capturetest

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"golang.org/x/sys/unix"
)

// Doer runs fn inside a network namespace (harness.NS and harness.FdNS).
type Doer interface {
	Do(fn func() error) error
}

// Landing is one connection or datagram a listener received.
type Landing struct {
	// Listener names the listener ("capture" or the name given).
	Listener string
	// Payload is what the client sent.
	Payload string
	// Dst is the destination the listener saw: the accepted socket's local
	// address for TCP (the original destination under TPROXY), the
	// IP_ORIGDSTADDR of a datagram for UDP.
	Dst netip.AddrPort
}

// Sink collects landings from every listener of a test.
type Sink struct {
	c chan Landing
}

// NewSink returns an empty sink.
func NewSink() *Sink { return &Sink{c: make(chan Landing, 64)} }

// Wait returns the landing carrying payload, or an error when none arrived
// before ctx ends. Landings of other payloads are dropped.
func (s *Sink) Wait(ctx context.Context, payload string) (Landing, error) {
	for {
		select {
		case l := <-s.c:
			if l.Payload == payload {
				return l, nil
			}
		case <-ctx.Done():
			return Landing{}, fmt.Errorf("payload %q landed nowhere: %w", payload, ctx.Err())
		}
	}
}

func transparent(network string) func(string, string, syscall.RawConn) error {
	return func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			if strings.HasSuffix(network, "6") {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
				if serr == nil && strings.HasPrefix(network, "udp") {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1)
				}
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
				if serr == nil && strings.HasPrefix(network, "udp") {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1)
				}
			}
		})
		if err != nil {
			return err
		}
		return serr
	}
}

// Listen binds, inside n, a listener named name on each of the given
// networks ("tcp4", "tcp6", "udp4", "udp6") at port, transparent
// (IP_TRANSPARENT, as the proxy's capture listener is) when tproxy is set,
// and feeds what arrives into s. Everything is closed in t.Cleanup.
func Listen(t testing.TB, n Doer, s *Sink, name string, port uint16, tproxy bool, networks ...string) {
	t.Helper()
	for _, network := range networks {
		host := "0.0.0.0"
		if strings.HasSuffix(network, "6") {
			host = "::"
		}
		addr := net.JoinHostPort(host, fmt.Sprint(port))
		lc := net.ListenConfig{}
		if tproxy {
			lc.Control = transparent(network)
		}
		err := n.Do(func() error {
			if strings.HasPrefix(network, "tcp") {
				l, err := lc.Listen(context.Background(), network, addr)
				if err != nil {
					return err
				}
				t.Cleanup(func() { l.Close() })
				go serveTCP(l, s, name)
				return nil
			}
			pc, err := lc.ListenPacket(context.Background(), network, addr)
			if err != nil {
				return err
			}
			t.Cleanup(func() { _ = pc.Close() })
			go serveUDP(pc.(*net.UDPConn), s, name)
			return nil
		})
		if err != nil {
			t.Fatalf("failed to listen on %s %s: %v", network, addr, err)
		}
	}
}

func serveTCP(l net.Listener, s *Sink, name string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			buf := make([]byte, 256)
			n, _ := c.Read(buf)
			dst := c.LocalAddr().(*net.TCPAddr).AddrPort()
			s.c <- Landing{Listener: name, Payload: string(buf[:n]), Dst: netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())}
			_, _ = c.Write([]byte("ok"))
		}()
	}
}

func serveUDP(pc *net.UDPConn, s *Sink, name string) {
	buf := make([]byte, 256)
	oob := make([]byte, 256)
	for {
		n, oobn, _, _, err := pc.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			return
		}
		l := Landing{Listener: name, Payload: string(buf[:n])}
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				switch {
				case m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR && len(m.Data) >= 8:
					a, _ := netip.AddrFromSlice(m.Data[4:8])
					l.Dst = netip.AddrPortFrom(a, binary.BigEndian.Uint16(m.Data[2:4]))
				case m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR && len(m.Data) >= 24:
					a, _ := netip.AddrFromSlice(m.Data[8:24])
					l.Dst = netip.AddrPortFrom(a, binary.BigEndian.Uint16(m.Data[2:4]))
				}
			}
		}
		if !l.Dst.IsValid() {
			if la, ok := pc.LocalAddr().(*net.UDPAddr); ok {
				l.Dst = la.AddrPort()
			}
		}
		s.c <- l
	}
}

// Send sends payload from inside n to dst over network ("tcp" or "udp"),
// optionally with SO_MARK mark (0 = none), and returns once sent. For TCP it
// also waits for the listener's answer, so a refused or unrouted connection
// is an error.
func Send(n Doer, network string, dst netip.AddrPort, payload string, mark uint32) error {
	return SendFrom(n, network, netip.Addr{}, dst, payload, mark)
}

// SendFrom is Send from the local address src (the zero Addr lets the
// kernel choose).
func SendFrom(n Doer, network string, src netip.Addr, dst netip.AddrPort, payload string, mark uint32) error {
	d := net.Dialer{Timeout: 5 * time.Second}
	if src.IsValid() {
		if network == "tcp" {
			d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
		} else {
			d.LocalAddr = net.UDPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
		}
	}
	if mark != 0 {
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
			}); err != nil {
				return err
			}
			return serr
		}
	}
	var c net.Conn
	if err := n.Do(func() error {
		var err error
		c, err = d.Dial(network, dst.String())
		return err
	}); err != nil {
		return fmt.Errorf("failed to dial %s %s: %w", network, dst, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(payload)); err != nil {
		return fmt.Errorf("failed to send to %s %s: %w", network, dst, err)
	}
	if network == "tcp" {
		buf := make([]byte, 2)
		if _, err := c.Read(buf); err != nil {
			return fmt.Errorf("no answer from %s %s: %w", network, dst, err)
		}
	}
	return nil
}

// WaitAddrsSettled waits (up to 30 s) until no IPv6 address in n is
// tentative, so the first IPv6 packet of a test does not race duplicate
// address detection.
func WaitAddrsSettled(t testing.TB, n Doer) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		tentative := false
		err := n.Do(func() error {
			addrs, err := netlinksafe.AddrList(nil, unix.AF_INET6)
			if err != nil {
				return err
			}
			for _, a := range addrs {
				if a.Flags&unix.IFA_F_TENTATIVE != 0 {
					tentative = true
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("failed to list addresses: %v", err)
		}
		if !tentative {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("IPv6 addresses still tentative after 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
