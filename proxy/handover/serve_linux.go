package handover

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"
)

// Offerer is the old proxy's side of a hand-over.
type Offerer interface {
	// Offer returns a copy (dup) of every listening socket the proxy
	// serves; Serve closes the copies once sent.
	Offer() ([]Socket, error)
	// Commit stops accepting on every socket (the successor accepts on
	// them now) and starts the drain; called once, after the ack.
	Commit()
}

// Serve answers successors on ln, one at a time, until one acknowledges:
// then it closes ln, calls Commit and returns nil. A session that fails
// before its ack (the successor exits, errs, or sends no ack within
// ackTimeout) changes nothing: the proxy goes on serving and Serve waits
// for the next successor. It returns ctx's error when ctx ends first.
func Serve(ctx context.Context, ln *net.UnixListener, o Offerer, ackTimeout time.Duration, log *slog.Logger) error {
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			log.Warn("hand-over accept failed", "error", err.Error())
			continue
		}
		committed, err := session(ctx, c, o, ackTimeout, ln)
		_ = c.Close()
		if committed {
			return nil
		}
		log.Warn("hand-over to a successor failed; serving on", "error", err.Error())
	}
}

// session runs one hand-over with the successor on c; true once committed.
func session(ctx context.Context, c *net.UnixConn, o Offerer, ackTimeout time.Duration, ln *net.UnixListener) (bool, error) {
	if err := peerAllowed(c); err != nil {
		return false, err
	}
	deadline(ctx, c, 5*time.Second)
	m, fds, err := recv(c)
	closeFds(fds)
	if err != nil {
		return false, err
	}
	if m.Op != "take" || m.Version != Version {
		return false, fmt.Errorf("hand-over request %q version %d: want take version %d", m.Op, m.Version, Version)
	}
	socks, err := o.Offer()
	if err != nil {
		return false, err
	}
	err = sendAll(c, socks)
	for _, s := range socks {
		_ = s.File.Close()
	}
	if err != nil {
		return false, err
	}
	deadline(ctx, c, ackTimeout)
	m, fds, err = recv(c)
	closeFds(fds)
	if err != nil {
		return false, fmt.Errorf("successor ended the hand-over before its ack: %w", err)
	}
	if m.Op != "ack" {
		return false, fmt.Errorf("hand-over message %q: want ack", m.Op)
	}
	// Committed: the successor accepts on every socket. A later successor
	// asks it, not this proxy.
	_ = ln.Close()
	o.Commit()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_ = send(c, message{Op: "done"}, nil) // the successor may be gone: nothing to undo
	return true, nil
}

// sendAll sends socks in batches of descriptors, then end.
func sendAll(c *net.UnixConn, socks []Socket) error {
	total := len(socks)
	for len(socks) > 0 {
		n := min(len(socks), batch)
		files := make([]*os.File, n)
		for i := range files {
			files[i] = socks[i].File
		}
		if err := send(c, message{Op: "sockets", Sockets: socks[:n]}, files); err != nil {
			return err
		}
		socks = socks[n:]
	}
	return send(c, message{Op: "end", Count: total}, nil)
}
