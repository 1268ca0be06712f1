package flowapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"syscall"
)

// Stream is a subscription: the messages the server sends after its
// answer. Not safe for concurrent use.
type Stream struct {
	conn net.Conn
	dec  *json.Decoder
	stop func() bool
	// Queue is the bound of this client's queue on the server.
	Queue int
}

// Subscribe connects to the flows socket at path, sends req and reads the
// server's answer. The stream ends when ctx does (Next then fails). Errors:
// ErrNoSocket (wrapped) when nothing serves path, one that says so when the
// socket may not be opened (not root), *RefusedError when the server
// refused the request.
func Subscribe(ctx context.Context, path string, req Request) (*Stream, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, dialError(path, err)
	}
	s := &Stream{conn: c, dec: json.NewDecoder(c), stop: context.AfterFunc(ctx, func() { _ = c.Close() })}
	line, err := json.Marshal(req)
	if err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("failed to encode flows request: %w", err)
	}
	// A server that refuses the peer answers (and closes) without reading
	// the request: its answer is still read after a failed write.
	_, werr := c.Write(append(line, '\n'))
	m, err := s.Next()
	if err != nil {
		_ = s.Close()
		if werr != nil {
			return nil, fmt.Errorf("failed to send flows request to %q: %w", path, orCtx(ctx, werr))
		}
		return nil, fmt.Errorf("failed to read the answer of flows socket %q: %w", path, orCtx(ctx, err))
	}
	switch m.Type {
	case TypeSubscribed:
		s.Queue = m.Queue
		return s, nil
	case TypeError:
		_ = s.Close()
		return nil, &RefusedError{Detail: m.Detail}
	}
	_ = s.Close()
	return nil, fmt.Errorf("unexpected answer %q from flows socket %q: want %s or %s", m.Type, path, TypeSubscribed, TypeError)
}

// Next returns the next message; io.EOF when the server closed the stream.
func (s *Stream) Next() (Message, error) {
	var m Message
	err := s.dec.Decode(&m)
	return m, err
}

// Close ends the subscription.
func (s *Stream) Close() error {
	s.stop()
	return s.conn.Close()
}

// dialError explains a failed connect to path: nothing serves it, or the
// caller may not open it.
func dialError(path string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("%w at %q (%w): aether-proxy serves it, as root, at its -flows-socket path (default %s); is aether-proxy running on this node with that path?", ErrNoSocket, path, err, DefaultSocket)
	case errors.Is(err, fs.ErrPermission):
		return fmt.Errorf("permission denied on flows socket %q (%w): it is root's, mode 0600; run aetherctl flows as root", path, err)
	}
	return fmt.Errorf("failed to connect to flows socket %q: %w", path, err)
}

// orCtx prefers the context's error to the one its cancellation caused.
func orCtx(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
