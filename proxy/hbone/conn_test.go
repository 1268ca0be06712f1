package hbone_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

// countingConn counts the write(2) calls made on a TCP connection.
type countingConn struct {
	net.Conn
	mu     sync.Mutex
	writes int
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes++
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *countingConn) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writes
}

// TestOneWritePerDataFrame: a bulk upload costs the client one write(2) per
// 16 KiB DATA frame, not one per TLS record (each frame plus its 9-byte
// header is two records: crypto/tls alone writes them with two syscalls).
func TestOneWritePerDataFrame(t *testing.T) {
	e := newEnv(t, nil)
	conns := make(chan *countingConn, 1)
	d, err := hbone.NewDialer(hbone.DialerConfig{
		Certs: e.certs,
		DialContext: func(ctx context.Context, network, address string) (net.Conn, error) {
			var nd net.Dialer
			c, err := nd.DialContext(ctx, network, address)
			if err != nil {
				return nil, err
			}
			cc := &countingConn{Conn: c}
			conns <- cc
			return cc, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	req := e.request()
	req.Target = hbonetest.Sink(t)
	s, err := d.Dial(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	wire := <-conns
	before := wire.count()
	const frames = 64
	chunk := make([]byte, hbone.DefaultMaxFrameSize)
	if err := hbonetest.SendCounted(s, chunk, frames); err != nil {
		t.Fatal(err)
	}
	// frames DATA frames, the 8-byte length prefix, and a few control
	// frames (SETTINGS ack, WINDOW_UPDATE for the sink's answer).
	if got := wire.count() - before; got > frames+8 {
		t.Errorf("client write(2) calls for %d DATA frames = %d, want at most %d", frames, got, frames+8)
	}
}
