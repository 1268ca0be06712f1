package handover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Version is the protocol version both sides must speak.
const Version = 1

// DefaultAckTimeout is how long the old proxy waits, once it sent its
// sockets, for the successor's ack before it drops the session and goes on
// serving (the successor syncs with the agent meanwhile).
const DefaultAckTimeout = 60 * time.Second

// Socket is one listening socket handed over, with what it is.
type Socket struct {
	// Pod is the pod key the socket serves; "" for the proxy's own (the
	// admin and metrics addresses).
	Pod string `json:"pod,omitempty"`
	// Name is the listener's name (xDS), or "hbone", "admin", "metrics",
	// "flows".
	Name string `json:"name"`
	// Network is tcp4, tcp6, udp4, udp6 or unix.
	Network string `json:"network"`
	// Addr is the socket's local address as getsockname gives it (a path
	// for unix).
	Addr string `json:"addr"`
	// File is the descriptor: the sender's copy while it offers, the
	// receiver's own once taken (its owner closes it).
	File *os.File `json:"-"`
}

// Key names the socket's place: its pod, listener, network and address.
func (s Socket) Key() string { return Key(s.Pod, s.Name, s.Network, s.Addr) }

// Key is Socket.Key of the parts.
func Key(pod, name, network, addr string) string {
	return pod + "|" + name + "|" + network + "|" + addr
}

// message is one SOCK_SEQPACKET datagram of the protocol.
type message struct {
	// Op is take (successor: send me your sockets), sockets (a batch, its
	// descriptors attached in order), end (all sent), ack (successor: I
	// accept on them, stop accepting) or done (old: I accept nothing any
	// more).
	Op      string   `json:"op"`
	Version int      `json:"version,omitempty"`
	Sockets []Socket `json:"sockets,omitempty"`
	Count   int      `json:"count,omitempty"`
}

// batch is the most descriptors one message carries (the kernel's
// SCM_MAX_FD is 253).
const batch = 250

// ErrNoPredecessor says no proxy serves the hand-over socket (none runs,
// or the socket is stale); the caller binds as a first proxy does.
var ErrNoPredecessor = errors.New("no running proxy to take over from")

// Listen binds the hand-over socket at path (mode 0600 in a dir of mode
// 0700), replacing whatever is there atomically: a stale socket, or the
// one of the proxy just taken over from, which no longer listens.
func Listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("failed to create hand-over socket dir of %q: %w", path, err)
	}
	tmp := path + ".new." + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("failed to listen on hand-over socket %q: %w", tmp, err)
	}
	// The successor replaces the path: never unlink it at close.
	ln.SetUnlinkOnClose(false)
	err = os.Chmod(tmp, 0o600)
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = ln.Close()
		_ = os.Remove(tmp)
		return nil, fmt.Errorf("failed to publish hand-over socket %q: %w", path, err)
	}
	return ln, nil
}

// peerAllowed accepts a peer running as root or as this process's user
// (SO_PEERCRED): a listener's descriptor is never given to anyone else.
func peerAllowed(c *net.UnixConn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("failed to read hand-over peer credentials: %w", serr)
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("hand-over peer uid %d refused: only root or uid %d", cred.Uid, os.Geteuid())
	}
	return nil
}

// send writes m with the descriptors of files attached, in order.
func send(c *net.UnixConn, m message, files []*os.File) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	fds := make([]int, 0, len(files))
	for _, f := range files {
		// The caller holds every file open until send returns, so the
		// numbers stay theirs.
		if err := WithFd(f, func(fd int) error { fds = append(fds, fd); return nil }); err != nil {
			return fmt.Errorf("failed to send hand-over %s: %w", m.Op, err)
		}
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("failed to send hand-over %s: %w", m.Op, err)
	}
	return nil
}

// WithFd runs fn with f's descriptor. Unlike f.Fd, it leaves the file
// non-blocking: O_NONBLOCK belongs to the open file description, which the
// listener's every copy shares, so Fd would turn the serving proxy's
// listener blocking too (its accept loops then sleep in accept(2) and its
// Close waits for them).
func WithFd(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// recv reads one message and the descriptors it carries (the caller
// closes them, also on error).
func recv(c *net.UnixConn) (message, []int, error) {
	var m message
	buf, oob := make([]byte, 256<<10), make([]byte, unix.CmsgSpace(4*batch))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return m, nil, fmt.Errorf("failed to read hand-over message: %w", err)
	}
	var fds []int
	if oobn > 0 {
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		for _, cm := range cms {
			got, ferr := unix.ParseUnixRights(&cm)
			fds = append(fds, got...)
			err = errors.Join(err, ferr)
		}
		if err != nil {
			return m, fds, fmt.Errorf("failed to parse hand-over descriptors: %w", err)
		}
	}
	if n == 0 {
		return m, fds, fmt.Errorf("failed to read hand-over message: %w", net.ErrClosed)
	}
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		return m, fds, fmt.Errorf("failed to decode hand-over message: %w", err)
	}
	return m, fds, nil
}

// validate checks that fd is what s says: the socket type and family of
// its network, listening (TCP), bound to its address.
func validate(s Socket, fd int) error {
	typ, family := unix.SOCK_STREAM, unix.AF_INET
	switch s.Network {
	case "tcp4":
	case "tcp6":
		family = unix.AF_INET6
	case "udp4":
		typ = unix.SOCK_DGRAM
	case "udp6":
		typ, family = unix.SOCK_DGRAM, unix.AF_INET6
	case "unix":
		family = unix.AF_UNIX
	default:
		return fmt.Errorf("network %q: want tcp4, tcp6, udp4, udp6 or unix", s.Network)
	}
	if err := sockopt(fd, unix.SO_TYPE, "SO_TYPE", typ); err != nil {
		return fmt.Errorf("not a %s socket: %w", s.Network, err)
	}
	if err := sockopt(fd, unix.SO_DOMAIN, "SO_DOMAIN", family); err != nil {
		return fmt.Errorf("not a %s socket: %w", s.Network, err)
	}
	if typ == unix.SOCK_STREAM {
		if err := sockopt(fd, unix.SO_ACCEPTCONN, "SO_ACCEPTCONN", 1); err != nil {
			return fmt.Errorf("socket is not listening: %w", err)
		}
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return fmt.Errorf("failed to read the socket's address: %w", err)
	}
	if a, ok := sa.(*unix.SockaddrUnix); ok {
		if a.Name != s.Addr {
			return fmt.Errorf("socket bound to %q: want %q", a.Name, s.Addr)
		}
		return nil
	}
	want, err := netip.ParseAddrPort(s.Addr)
	if err != nil {
		return fmt.Errorf("address %q: %w", s.Addr, err)
	}
	var got netip.AddrPort
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		got = netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		got = netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	}
	got, want = netip.AddrPortFrom(got.Addr().Unmap(), got.Port()), netip.AddrPortFrom(want.Addr().Unmap(), want.Port())
	if got != want {
		return fmt.Errorf("socket bound to %s: want %s", got, want)
	}
	return nil
}

// sockopt checks that the SOL_SOCKET option opt (named name) of fd is want.
func sockopt(fd, opt int, name string, want int) error {
	v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, opt)
	if err != nil {
		return fmt.Errorf("failed to read %s: %w", name, err)
	}
	if v != want {
		return fmt.Errorf("%s is %d: want %d", name, v, want)
	}
	return nil
}

// deadline sets c's deadline from ctx, or d from now when ctx has none.
func deadline(ctx context.Context, c *net.UnixConn, d time.Duration) {
	t, ok := ctx.Deadline()
	if !ok {
		t = time.Now().Add(d)
	}
	_ = c.SetDeadline(t)
}
