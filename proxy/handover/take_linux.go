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
	for {
		m, fds, err := recv(s.c)
		if err != nil {
			closeFds(fds)
			return err
		}
		switch {
		case m.Op == "end" && len(fds) == 0:
			if got := len(s.Sockets) + len(s.Rejected); got != m.Count {
				return fmt.Errorf("hand-over ended after %d sockets: the old proxy sent %d", got, m.Count)
			}
			return nil
		case m.Op == "sockets" && len(fds) == len(m.Sockets):
			s.add(m.Sockets, fds)
		default:
			closeFds(fds)
			return fmt.Errorf("hand-over message %q with %d sockets and %d descriptors: want sockets (one descriptor each) or end", m.Op, len(m.Sockets), len(fds))
		}
	}
}

// add validates each socket against its descriptor and keeps the valid.
func (s *Session) add(socks []Socket, fds []int) {
	for i, sock := range socks {
		if err := validate(sock, fds[i]); err != nil {
			closeFd(fds[i])
			s.Rejected = append(s.Rejected, fmt.Errorf("handed-over socket %s %s of %q: %w", sock.Network, sock.Addr, sock.Name, err))
			continue
		}
		sock.File = os.NewFile(uintptr(fds[i]), "handover:"+sock.Key())
		s.Sockets = append(s.Sockets, sock)
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
	m, fds, err := recv(s.c)
	closeFds(fds)
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

func closeFd(fd int) { _ = unix.Close(fd) }

func closeFds(fds []int) {
	for _, fd := range fds {
		closeFd(fd)
	}
}
