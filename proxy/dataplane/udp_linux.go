package dataplane

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// UDP forwarding. The first datagram of a flow (source, original
// destination) reaches the transparent capture socket, which reads the
// original destination from IP_ORIGDSTADDR / IPV6_ORIGDSTADDR. The proxy then
// opens, inside the pod netns, two sockets for the flow:
//   - upstream: connected to the original destination, SO_MARK = bypass mark;
//   - back: IP_TRANSPARENT, bound to the original destination and connected
//     to the source, so replies reach the client from the address it sent
//     to. The divert's TPROXY rule finds this connected transparent socket
//     for the flow's later datagrams (its established lookup comes first),
//     so they arrive on it and are forwarded upstream.
// A flow ends after UDPIdleTimeout without a datagram either way, and at
// once when the pod drains.

type udpListener struct {
	conn *net.UDPConn
	port uint16
	// name and network (udp4, udp6) are its listener's, for the hand-over.
	name, network string
}

type flowKey struct{ src, dst netip.AddrPort }

type udpFlow struct {
	up, back *net.UDPConn
	last     atomic.Int64 // unix nanos of the last datagram
	once     sync.Once
	done     func()
}

func (f *udpFlow) abort() {
	f.once.Do(func() {
		_ = f.up.Close()
		_ = f.back.Close()
		f.done()
	})
}

func origDst(oob []byte) (netip.AddrPort, bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.AddrPort{}, false
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR && len(m.Data) >= 8:
			a, _ := netip.AddrFromSlice(m.Data[4:8])
			return netip.AddrPortFrom(a, binary.BigEndian.Uint16(m.Data[2:4])), true
		case m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR && len(m.Data) >= 24:
			a, _ := netip.AddrFromSlice(m.Data[8:24])
			return netip.AddrPortFrom(a.Unmap(), binary.BigEndian.Uint16(m.Data[2:4])), true
		}
	}
	return netip.AddrPort{}, false
}

func (p *pod) udpLoop(u *udpListener) {
	buf := make([]byte, 64*1024)
	oob := make([]byte, 256)
	for {
		n, oobn, _, src, err := u.conn.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.ctx.Err() != nil {
				return
			}
			continue
		}
		src = netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
		dst, ok := origDst(oob[:oobn])
		if !ok || p.isLoop(dst, u.port) {
			p.m.metrics.Datagram("outbound", "no_original_destination")
			continue
		}
		key := flowKey{src, dst}
		f := p.flow(key)
		if f == nil {
			if !p.admitFlow() {
				p.m.metrics.Datagram("outbound", "flow_limit")
				continue
			}
			var nf *udpFlow
			nf, err = p.newFlow(src, dst, func() { p.dropFlow(key, nf) })
			if err != nil {
				p.log.Debug("udp flow failed", "src", src, "dst", dst, "error", err)
				p.m.metrics.Datagram("outbound", "flow_failed")
				continue
			}
			f = nf
			p.addFlow(key, f)
		}
		f.last.Store(time.Now().UnixNano())
		if _, err := f.up.Write(buf[:n]); err != nil {
			p.m.metrics.Datagram("outbound", "send_failed")
			continue
		}
		p.m.metrics.Datagram("outbound", "forwarded")
	}
}

func reuseTransparent(network, address string, rc syscall.RawConn) error {
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("failed to set SO_REUSEADDR: %w", os.NewSyscallError("setsockopt", serr))
	}
	return transparentControl(false)(network, address, rc)
}

func (p *pod) newFlow(src, dst netip.AddrPort, done func()) (*udpFlow, error) {
	f := &udpFlow{done: done}
	err := p.netns.do(func() error {
		d := net.Dialer{Control: markControl(p.m.cfg.BypassMark)}
		up, err := d.DialContext(context.Background(), "udp", dst.String())
		if err != nil {
			return fmt.Errorf("failed to open upstream udp socket to %s: %w", dst, err)
		}
		bd := net.Dialer{LocalAddr: net.UDPAddrFromAddrPort(dst), Control: reuseTransparent}
		back, err := bd.DialContext(context.Background(), "udp", src.String())
		if err != nil {
			up.Close()
			return fmt.Errorf("failed to open transparent reply socket %s->%s: %w", dst, src, err)
		}
		f.up, f.back = up.(*net.UDPConn), back.(*net.UDPConn)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if !p.track(f) {
		f.abort()
		return nil, errClosed
	}
	f.last.Store(time.Now().UnixNano())
	p.wg.Add(2)
	idle := p.m.cfg.UDPIdleTimeout
	if dst.Port() == 53 {
		idle = p.m.cfg.DNSIdleTimeout
	}
	relay := func(from, to *net.UDPConn, direction string) {
		defer p.wg.Done()
		defer f.abort()
		defer p.untrack(f)
		buf := make([]byte, 64*1024)
		for {
			_ = from.SetReadDeadline(time.Now().Add(idle))
			n, err := from.Read(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() && time.Since(time.Unix(0, f.last.Load())) < idle {
					continue
				}
				return
			}
			f.last.Store(time.Now().UnixNano())
			if _, err := to.Write(buf[:n]); err != nil {
				p.m.metrics.Datagram(direction, "send_failed")
				continue
			}
			p.m.metrics.Datagram(direction, "forwarded")
		}
	}
	go relay(f.up, f.back, "reply")
	go relay(f.back, f.up, "outbound")
	return f, nil
}
