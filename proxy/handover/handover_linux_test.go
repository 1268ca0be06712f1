package handover_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"aether.io/node/proxy/handover"
)

// offerer offers the listeners of lns (and one socket that lies about its
// address when lie is set) and counts commits.
type offerer struct {
	lns     []*net.TCPListener
	lie     bool
	commits atomic.Int32
}

func (o *offerer) Offer() ([]handover.Socket, error) {
	var out []handover.Socket
	for i, ln := range o.lns {
		f, err := ln.File()
		if err != nil {
			return nil, err
		}
		addr := ln.Addr().(*net.TCPAddr).AddrPort()
		if o.lie && i == 0 {
			addr = netip.AddrPortFrom(addr.Addr(), addr.Port()+1)
		}
		out = append(out, handover.Socket{Pod: "pod-a", Name: "capture", Network: "tcp4", Addr: addr.String(), File: f})
	}
	return out, nil
}

func (o *offerer) Commit() { o.commits.Add(1) }

func serve(t *testing.T, o *offerer) (string, chan error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "run", "handover.sock")
	ln, err := handover.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done, finished := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(finished)
		done <- handover.Serve(ctx, ln, o, 5*time.Second, slog.New(slog.DiscardHandler))
	}()
	t.Cleanup(func() { cancel(); <-finished })
	return path, done
}

func listen(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln.(*net.TCPListener)
}

// TestTakeAckCommit: the successor receives the very listening socket (a
// connection queued on the old listener is accepted through the handed
// copy), the old side commits only on the ack, and stops serving.
func TestTakeAckCommit(t *testing.T) {
	ln := listen(t)
	o := &offerer{lns: []*net.TCPListener{ln}}
	path, done := serve(t, o)
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("hand-over socket mode %v (%v): want 0600", fi.Mode().Perm(), err)
	}
	queued, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer queued.Close()
	s, err := handover.Take(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if len(s.Sockets) != 1 || len(s.Rejected) != 0 {
		t.Fatalf("got %d sockets, %d rejected: want 1, 0", len(s.Sockets), len(s.Rejected))
	}
	got, err := net.FileListener(s.Sockets[0].File)
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	_ = s.Sockets[0].File.Close()
	_ = ln.Close() // the old copy closes: the kernel socket stays
	c, err := got.Accept()
	if err != nil {
		t.Fatalf("the connection queued before the hand-over was lost: %v", err)
	}
	_ = c.Close()
	if n := o.commits.Load(); n != 0 {
		t.Fatalf("committed %d times before the ack", n)
	}
	if err := s.Ack(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := o.commits.Load(); n != 1 {
		t.Fatalf("committed %d times after the ack: want 1", n)
	}
	if err := <-done; err != nil {
		t.Fatalf("Serve after a commit: %v", err)
	}
}

// TestAbandonedSessionCommitsNothing: a successor that goes away before
// its ack leaves the old side uncommitted and serving the next one.
func TestAbandonedSessionCommitsNothing(t *testing.T) {
	o := &offerer{lns: []*net.TCPListener{listen(t)}}
	path, _ := serve(t, o)
	s, err := handover.Take(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	for _, sock := range s.Sockets {
		_ = sock.File.Close()
	}
	s.Close()
	s, err = handover.Take(context.Background(), path)
	if err != nil {
		t.Fatalf("a second successor after an abandoned one: %v", err)
	}
	defer s.Close()
	if n := o.commits.Load(); n != 0 {
		t.Fatalf("an abandoned session committed %d times", n)
	}
	if err := s.Ack(context.Background()); err != nil || o.commits.Load() != 1 {
		t.Fatalf("ack of the second successor: %v, %d commits", err, o.commits.Load())
	}
}

// TestRejectsMislabelledSocket: a socket whose address is not the one it
// is said to have is refused and closed, the others taken.
func TestRejectsMislabelledSocket(t *testing.T) {
	o := &offerer{lns: []*net.TCPListener{listen(t), listen(t)}, lie: true}
	path, _ := serve(t, o)
	s, err := handover.Take(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if len(s.Sockets) != 1 || len(s.Rejected) != 1 {
		t.Fatalf("got %d sockets, %d rejected (%v): want 1, 1", len(s.Sockets), len(s.Rejected), s.Rejected)
	}
	t.Log(s.Rejected[0])
}

// TestNoPredecessor: no socket, or a stale one nobody serves.
func TestNoPredecessor(t *testing.T) {
	dir := t.TempDir()
	if _, err := handover.Take(context.Background(), filepath.Join(dir, "none.sock")); !errors.Is(err, handover.ErrNoPredecessor) {
		t.Fatalf("no socket: %v, want ErrNoPredecessor", err)
	}
	stale := filepath.Join(dir, "stale.sock")
	ln, err := handover.Listen(stale)
	if err != nil {
		t.Fatal(err)
	}
	_ = ln.Close()
	if _, err := handover.Take(context.Background(), stale); !errors.Is(err, handover.ErrNoPredecessor) {
		t.Fatalf("stale socket: %v, want ErrNoPredecessor", err)
	}
}
