package hbone

import (
	"context"
	"crypto/tls"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// maxBatch bounds the TLS records one write(2) carries: a 16 KiB DATA frame
// is two records (16 KiB + its 9-byte header's spill-over), a 64 KiB one
// five; the Dialer's Stream.Write sends up to 240 KiB of 16 KiB frames with
// one TLS write, which one write(2) carries (80 KiB before: 3 writes).
const maxBatch = 256 << 10

var batchBufs = sync.Pool{New: func() any { b := make([]byte, 0, maxBatch); return &b }}

// recordBatcher is the TCP connection under an HBONE tls.Conn. crypto/tls
// writes every TLS record with its own write(2); while a Write of the
// connection above runs (one HTTP/2 flush), the batcher collects the records
// and sends them with one write(2) when that Write ends. Writes outside a
// batch (handshake, alerts, a key update answered by a read) pass through.
// crypto/tls writes records under its own lock, so records stay in order.
type recordBatcher struct {
	net.Conn

	mu      sync.Mutex
	holding int     // batches open (Writes of the conn above in progress)
	buf     *[]byte // records collected, nil when none (pooled)
	err     error   // first write error: the record stream is broken

	// Reads (only the tls.Conn's reading goroutine): with beforeRead set
	// (the server), the socket is read in reads of up to 256 KiB into a
	// pooled buffer held only while it has bytes tls.Conn has not taken,
	// and beforeRead runs before each read(2).
	beforeRead func()
	rbuf       *[]byte
	rlo, rhi   int
}

// Read gives tls.Conn the socket's bytes.
func (b *recordBatcher) Read(p []byte) (int, error) {
	if b.beforeRead == nil {
		return b.Conn.Read(p)
	}
	if b.rbuf == nil {
		b.beforeRead()
		buf, n, err := readSocket(b.Conn)
		if err != nil {
			return 0, err
		}
		b.rbuf, b.rlo, b.rhi = buf, frameHeaderLen, frameHeaderLen+n
	}
	n := copy(p, (*b.rbuf)[b.rlo:b.rhi])
	b.rlo += n
	if b.rlo == b.rhi {
		sockBufs.Put(b.rbuf)
		b.rbuf = nil
	}
	return n, nil
}

func (b *recordBatcher) begin() {
	b.mu.Lock()
	b.holding++
	b.mu.Unlock()
}

// end closes a batch and writes its records when it is the last one open.
func (b *recordBatcher) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.holding--
	if b.holding > 0 {
		return b.err
	}
	return b.flushLocked()
}

func (b *recordBatcher) flushLocked() error {
	if b.buf == nil {
		return b.err
	}
	buf := b.buf
	b.buf = nil
	if b.err == nil && len(*buf) > 0 {
		_, b.err = b.Conn.Write(*buf)
	}
	*buf = (*buf)[:0]
	batchBufs.Put(buf)
	return b.err
}

// Write is called by crypto/tls once per record.
func (b *recordBatcher) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return 0, b.err
	}
	if b.holding == 0 {
		n, err := b.Conn.Write(p)
		if err != nil {
			b.err = err
		}
		return n, err
	}
	if b.buf != nil && len(*b.buf)+len(p) > maxBatch {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
	}
	if b.buf == nil {
		b.buf = batchBufs.Get().(*[]byte)
	}
	*b.buf = append(*b.buf, p...)
	return len(p), nil
}

// hboneConn is an established HBONE connection: TLS 1.3 over a
// recordBatcher, so each Write (an HTTP/2 flush) costs one write(2). Both
// HTTP/2 engines (the Server's h2Conn, the Dialer's h2Client) write frames
// through beginBatch/endBatch, so several frames share one write(2).
type hboneConn struct {
	tc      *tls.Conn
	raw     *recordBatcher
	peer    spiffeid.ID  // the peer's verified SPIFFE ID; zero when none
	writing atomic.Int32 // Writes in progress, for Close
}

var _ net.Conn = (*hboneConn)(nil)

// handshake runs the TLS handshake of tc (built over raw) and returns the
// connection with the peer's SPIFFE ID, read once here rather than per
// stream.
func handshake(ctx context.Context, raw *recordBatcher, tc *tls.Conn) (*hboneConn, error) {
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, err
	}
	peer, _ := peerID(tc.ConnectionState().PeerCertificates)
	return &hboneConn{tc: tc, raw: raw, peer: peer}, nil
}

func (c *hboneConn) Read(p []byte) (int, error) { return c.tc.Read(p) }

// Write sends p as TLS records with one write(2).
func (c *hboneConn) Write(p []byte) (int, error) {
	// No defer here: with net/http's client (before the Dialer's own
	// engine) this frame sat on every stream's request-writing goroutine,
	// and a defer plus a wrapper type grew its stack from 4 to 8 KiB.
	c.writing.Add(1)
	c.raw.begin()
	n, err := c.tc.Write(p)
	if ferr := c.raw.end(); err == nil && ferr != nil {
		n, err = 0, ferr
	}
	c.writing.Add(-1)
	return n, err
}

// setBeforeRead turns on batched socket reads with f called before each
// (the server's HTTP/2 engine writes its batched DATA there).
func (c *hboneConn) setBeforeRead(f func()) { c.raw.beforeRead = f }

// beginBatch starts a batch of Writes sent with one write(2) at endBatch.
func (c *hboneConn) beginBatch() {
	c.writing.Add(1)
	c.raw.begin()
}

// endBatch ends a batch and writes its records.
func (c *hboneConn) endBatch() error {
	err := c.raw.end()
	c.writing.Add(-1)
	return err
}

// Close closes the connection; as tls.Conn.Close does with a Write in
// flight, it then skips close_notify and just closes the socket, which
// unblocks that Write.
func (c *hboneConn) Close() error {
	if c.writing.Load() > 0 {
		_ = c.raw.Close() // the TCP socket
	}
	return c.tc.Close()
}

// ConnectionState returns the TLS state of the connection.
func (c *hboneConn) ConnectionState() tls.ConnectionState { return c.tc.ConnectionState() }

func (c *hboneConn) LocalAddr() net.Addr                { return c.tc.LocalAddr() }
func (c *hboneConn) RemoteAddr() net.Addr               { return c.tc.RemoteAddr() }
func (c *hboneConn) SetDeadline(t time.Time) error      { return c.tc.SetDeadline(t) }
func (c *hboneConn) SetReadDeadline(t time.Time) error  { return c.tc.SetReadDeadline(t) }
func (c *hboneConn) SetWriteDeadline(t time.Time) error { return c.tc.SetWriteDeadline(t) }
