package handover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Session is the successor's side of one hand-over: the sockets received,
// until Ack commits it or Close abandons it.
type Session struct {
	c *net.UnixConn
	// Sockets are the valid sockets received; their Files are the
	// caller's to close.
	Sockets []Socket
	// Rejected are the sockets that failed validation (closed already):
	// the caller binds those places itself once the old proxy is done.
	Rejected []error
}

// Take asks the proxy serving path for its listening sockets. It returns
// ErrNoPredecessor when none serves it (no socket, or a stale one).
func Take(ctx context.Context, path string) (*Session, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, ErrNoPredecessor
		}
		return nil, fmt.Errorf("failed to connect to hand-over socket %q: %w", path, err)
	}
	c := nc.(*net.UnixConn)
	s := &Session{c: c}
	if err := s.receive(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

func (s *Session) receive(ctx context.Context) error {
	if err := peerAllowed(s.c); err != nil {
		return err
	}
	deadline(ctx, s.c, 30*time.Second)
	if err := send(s.c, message{Op: "take", Version: Version}, nil); err != nil {
		return err
	}
	for n := 0; ; n++ {
		m, fd, err := recv(s.c)
		if err != nil {
			closeFd(fd)
			return err
		}
		switch {
		case m.Op == "end" && m.Count == n:
			closeFd(fd)
			return nil
		case m.Op == "socket" && m.Socket != nil && fd >= 0:
			if err := validate(*m.Socket, fd); err != nil {
				closeFd(fd)
				s.Rejected = append(s.Rejected, fmt.Errorf("handed-over socket %s %s of %q: %w", m.Socket.Network, m.Socket.Addr, m.Socket.Name, err))
				continue
			}
			sock := *m.Socket
			sock.File = os.NewFile(uintptr(fd), "handover:"+sock.Key())
			s.Sockets = append(s.Sockets, sock)
		default:
			closeFd(fd)
			return fmt.Errorf("hand-over message %q (socket %v, descriptor %v, %d sent): want socket or end", m.Op, m.Socket != nil, fd >= 0, n)
		}
	}
}

// Ack tells the old proxy that this one accepts on the sockets, and
// waits until it accepts on none (done). Once Ack is sent the hand-over is
// committed, whatever Ack returns.
func (s *Session) Ack(ctx context.Context) error {
	deadline(ctx, s.c, 10*time.Second)
	if err := send(s.c, message{Op: "ack"}, nil); err != nil {
		return err
	}
	m, fd, err := recv(s.c)
	closeFd(fd)
	if err != nil {
		return fmt.Errorf("failed to hear the old proxy stop accepting: %w", err)
	}
	if m.Op != "done" {
		return fmt.Errorf("hand-over message %q: want done", m.Op)
	}
	return nil
}

// Close ends the session; before Ack, the old proxy goes on serving as if
// nothing happened. The received Files stay the caller's.
func (s *Session) Close() { _ = s.c.Close() }

func closeFd(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}
