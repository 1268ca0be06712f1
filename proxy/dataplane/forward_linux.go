package dataplane

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/authz"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

func addrPort(a net.Addr) netip.AddrPort {
	switch v := a.(type) {
	case *net.TCPAddr:
		ap := v.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	case *net.UDPAddr:
		ap := v.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return netip.AddrPort{}
}

// dialTCP connects to dst from inside the pod's netns with the bypass mark.
// Only socket(2) and the SO_MARK run on a thread inside the netns (a
// socket's namespace is fixed at creation); the non-blocking connect and the
// wait for it happen on the calling goroutine, so no locked thread ever
// parks on the network.
func (p *pod) dialTCP(ctx context.Context, dst netip.AddrPort) (*net.TCPConn, error) {
	c, _, err := p.dialTCPFrom(ctx, dst, netip.AddrPort{})
	return c, err
}

// dialTCPFrom is dialTCP that, when from is valid (the client of an inbound
// delivery, same family as dst), tries to preserve the client's address:
// if the divert's deliver rule is in place (sourceRuleInstalled) the socket
// is transparent, carries the deliver mark instead of the bypass mark and is
// bound to from's address (a kernel-chosen port whose four-tuple to dst no
// other socket in the pod holds: bindTransparent). preserved says which it
// did.
func (p *pod) dialTCPFrom(ctx context.Context, dst, from netip.AddrPort) (c *net.TCPConn, preserved bool, err error) {
	var sa unix.Sockaddr
	family := unix.AF_INET6
	if dst.Addr().Is4() {
		family = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	} else {
		sa = &unix.SockaddrInet6{Port: int(dst.Port()), Addr: dst.Addr().As16()}
	}
	fd := -1
	err = p.netns.do(func() error {
		preserved = from.IsValid() && p.sourceRuleInstalled(from.Addr())
		var err error
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return os.NewSyscallError("socket", err)
		}
		mark := p.m.cfg.BypassMark
		if preserved {
			mark = p.m.cfg.DeliverMark
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
			unix.Close(fd)
			return fmt.Errorf("failed to set SO_MARK %#x: %w", mark, err)
		}
		if preserved {
			if err := bindTransparent(fd, from, dst); err != nil {
				unix.Close(fd)
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, preserved, fmt.Errorf("failed to create a socket in netns %q: %w", p.netns.path, err)
	}
	if err := unix.Connect(fd, sa); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		unix.Close(fd)
		return nil, preserved, fmt.Errorf("failed to connect to %s from netns %q: %w", dst, p.netns.path, err)
	}
	f := os.NewFile(uintptr(fd), "upstream")
	defer f.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = f.SetWriteDeadline(dl)
	}
	// A closing pod cancels ctx: end the wait at once.
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, preserved, err
	}
	var cerr error
	err = rc.Write(func(fd uintptr) bool {
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		switch {
		case err != nil:
			cerr = os.NewSyscallError("getsockopt", err)
		case v != 0:
			cerr = syscall.Errno(v)
		default:
			if _, err := unix.Getpeername(int(fd)); errors.Is(err, unix.ENOTCONN) {
				return false // still connecting: wait until writable
			}
		}
		return true
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return nil, preserved, fmt.Errorf("failed to connect to %s from netns %q: %w", dst, p.netns.path, err)
	}
	nc, err := net.FileConn(f)
	if err != nil {
		return nil, preserved, fmt.Errorf("failed to wrap the connection to %s: %w", dst, err)
	}
	return nc.(*net.TCPConn), preserved, nil
}

// upstream is the proxy's side towards the destination: a TCP connection,
// or the app's unix socket (inbound delivery over UDS).
type upstream interface {
	net.Conn
	CloseWrite() error
}

// tcpPair is one proxied connection.
type tcpPair struct {
	down *net.TCPConn
	up   upstream
	once sync.Once
	end  telemetry.End
	// tc is the pair's telemetry, for an inbound plaintext pair (set
	// before it is tracked: Reauthorize reports a refusal through it).
	tc *telemetry.Conn
	// az, for an inbound plaintext pair, is what it was authorized on
	// (Manager.Reauthorize); nil for outbound pairs.
	az *authz.Conn
	// finishing: finish ended the pair cleanly (a drain deadline); copy
	// errors from then on are its doing, not a reset.
	finishing atomic.Bool
}

// finishLinger is how long a pair finished at a drain deadline reads (and
// discards) what either side still sends before it closes: a close with
// unread data in a receive buffer would send a reset instead of a FIN.
const finishLinger = time.Second

// finish ends the pair with a clean close at a drain deadline: a FIN to
// both sides (shutdown SHUT_WR) at once; what either still sends is read
// and discarded until its own FIN or finishLinger, then pipe closes both.
func (t *tcpPair) finish() {
	t.end.Force(telemetry.ReasonDrainDeadline)
	t.finishing.Store(true)
	dl := time.Now().Add(finishLinger)
	_ = t.down.CloseWrite()
	_ = t.up.CloseWrite()
	_ = t.down.SetReadDeadline(dl)
	_ = t.up.SetReadDeadline(dl)
}

// copyHalf copies src to dst (pipe's one direction) and reports whether
// it ended in error. A pair being finished discards what src still sends
// instead, and never counts as failed.
func (t *tcpPair) copyHalf(pool *pipePool, dst, src net.Conn, add func(int64)) error {
	_, err := copyConn(pool, dst, src, add)
	if t.finishing.Load() {
		_, _ = io.Copy(io.Discard, src) // until the peer's FIN or the linger deadline
		return nil
	}
	return err
}

func (t *tcpPair) authorized() (authz.Conn, bool) {
	if t.az == nil {
		return authz.Conn{}, false
	}
	return *t.az, true
}

func (t *tcpPair) endWith(r telemetry.CloseReason) { t.end.Force(r) }

// denied records that policy now refuses the established pair.
func (t *tcpPair) denied(policy, reason string) {
	t.end.Force(telemetry.ReasonDenied)
	if t.tc != nil {
		t.tc.Deny(policy, reason)
	}
}

// abort resets both ends (a unix socket has no reset: it is closed).
func (t *tcpPair) abort() {
	t.once.Do(func() {
		reset(t.down)
		if up, ok := t.up.(*net.TCPConn); ok {
			reset(up)
		} else {
			_ = t.up.Close()
		}
	})
}

// proxyTCP forwards one captured connection to its original destination.
func (p *pod) proxyTCP(down *net.TCPConn, l *tcpListener) {
	dst := addrPort(down.LocalAddr()) // TPROXY: the original destination
	src := addrPort(down.RemoteAddr())
	if p.isLoop(dst, l.port) {
		p.m.metrics.Failed("loop")
		p.m.metrics.Misdirected(p.sourceInfo(src, dst, peers.Peer{}), errLoop)
		reset(down)
		return
	}
	if p.balanceTCP(down, src, dst) || p.tunnelTCP(down, src, dst) {
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.m.cfg.ConnectTimeout)
	up, err := p.dialTCP(ctx, dst)
	cancel()
	info := p.sourceInfo(src, dst, p.lookup(dst.Addr()))
	if err != nil {
		p.m.metrics.Failed("connect")
		p.m.metrics.Refused(info, telemetry.ReasonConnectFailed, err)
		p.log.Debug("upstream connect failed", "src", src, "dst", dst, "error", err)
		reset(down)
		return
	}
	p.pipeTCP(down, up, info)
}

// errLoop is the access log's error of a connection to the pod's own
// capture port.
var errLoop = errors.New("connection to the proxy's own capture port (not diverted): reset")

// pipeTCP relays a captured connection and its plain upstream until both
// are done, counted as the source side (info).
func (p *pod) pipeTCP(down, up *net.TCPConn, info telemetry.ConnInfo) {
	pair := &tcpPair{down: down, up: up}
	if !p.track(pair) {
		pair.abort()
		p.m.metrics.Refused(info, telemetry.ReasonPodClosed, nil)
		return
	}
	defer p.untrack(pair)
	tc := p.m.metrics.Open(info)
	tc.Close(pipe(&p.m.pipes, pair, tc))
}

// accountChunk is how many bytes a copy moves between two metric updates,
// so long-lived connections show their bytes before they end.
const accountChunk = 4 << 20

// copyConn copies src to dst until EOF or an error, reporting the bytes as
// they move (pipePool.splice). It splices between the sockets; when it
// cannot (a socket the kernel cannot splice from, no pipe to be had) the
// rest is copied through a buffer.
func copyConn(pool *pipePool, dst, src net.Conn, add func(int64)) (int64, error) {
	var n int64
	d, dok := dst.(syscall.Conn)
	s, sok := src.(syscall.Conn)
	if dok && sok {
		var err error
		if n, err = pool.splice(d, s, add); !errors.Is(err, errNoSplice) {
			return n, err
		}
	}
	m, err := copyCounted(dst, src, add)
	return n + m, err
}

// copyCounted copies src to dst through a buffer until EOF or an error,
// reporting progress every accountChunk bytes and at the end.
func copyCounted(dst io.Writer, src io.Reader, add func(int64)) (int64, error) {
	var total int64
	for {
		lr := &io.LimitedReader{R: src, N: accountChunk}
		n, err := io.Copy(dst, lr)
		total += n
		if n > 0 {
			add(n)
		}
		if err != nil {
			return total, err
		}
		if lr.N > 0 { // stopped short of the limit without an error: EOF
			return total, nil
		}
	}
}

// pipe copies both ways until both are done. A clean EOF on one side is
// passed on as a half-close (FIN); an error on either side resets both. The
// copies are splice(2) between the two sockets through pipes of pool.
// Bytes received from the downstream (source) and sent to it are reported
// as they move and whenever the connection goes idle. It returns how the
// connection ended and the copy error of a reset.
func pipe(pool *pipePool, t *tcpPair, tc *telemetry.Conn) (telemetry.CloseReason, error) {
	var wg sync.WaitGroup
	var upErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := t.copyHalf(pool, t.up, t.down, tc.Received); err != nil {
			upErr = err
			t.end.Force(telemetry.ReasonReset)
			t.abort()
			return
		}
		t.end.Finished(telemetry.ReasonClientClosed)
		_ = t.up.CloseWrite()
	}()
	downErr := t.copyHalf(pool, t.down, t.up, tc.Sent)
	if downErr != nil {
		t.end.Force(telemetry.ReasonReset)
		t.abort()
	} else {
		t.end.Finished(telemetry.ReasonServerClosed)
		_ = t.down.CloseWrite()
	}
	wg.Wait()
	t.once.Do(func() {
		_ = t.down.Close()
		_ = t.up.Close()
	})
	r := t.end.Reason(telemetry.ReasonClientClosed)
	return r, closeErr(r, errors.Join(upErr, downErr))
}

func (p *pod) lookup(a netip.Addr) (peer peers.Peer) {
	if p.m.peers == nil {
		return peer
	}
	peer, _ = p.m.peers.Lookup(a)
	return peer
}
