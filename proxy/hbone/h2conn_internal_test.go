package hbone

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// trickleConn reads at most 7 bytes per Read, so the engine's reads of a
// DATA payload span many reads of the socket (and beforeRead runs in the
// middle of each payload).
type trickleConn struct{ plainConn }

func (c *trickleConn) Read(p []byte) (int, error) { return c.plainConn.Read(p[:min(len(p), 7)]) }

// TestBatchedDataSplitReads: DATA batched for the upstream (readFrame)
// arrives intact and in order when the socket delivers every payload in
// pieces, with the batch written before each piece is read.
func TestBatchedDataSplitReads(t *testing.T) {
	echo := echoServer(t)
	srv, err := NewServer(ServerConfig{
		Identity: fuzzServer, Certs: noCerts{},
		Deliver: func(ctx context.Context, _ spiffeid.ID, _ netip.AddrPort) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", echo.String())
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	cli, _, _, served := serveConn(t, srv, loopbackListener(t), true)
	defer cli.Close()

	// The stream is delivered (its 200 read) before its DATA comes: DATA
	// for a stream still in Deliver is queued, not batched.
	if _, err := io.WriteString(cli, clientPreface); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Write(newFrames().settings().connect(1, portTCP, false).Bytes()); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(cli, cli)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	for {
		fm, err := fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		if h, ok := fm.(*http2.MetaHeadersFrame); ok {
			if s := h.PseudoValue("status"); s != "200" {
				t.Fatalf("status %q, want 200", s)
			}
			break
		}
	}
	var want bytes.Buffer
	f := newFrames()
	for i := range 40 {
		p := bytes.Repeat([]byte{byte('a' + i%26)}, 1000+i)
		want.Write(p)
		f.data(1, i == 39, string(p))
	}
	if _, err := cli.Write(f.Bytes()); err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	for {
		fm, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read after %d of %d echoed bytes: %v", got.Len(), want.Len(), err)
		}
		if d, ok := fm.(*http2.DataFrame); ok && d.StreamID == 1 {
			got.Write(d.Data())
			if d.StreamEnded() {
				break
			}
		}
		if _, ok := fm.(*http2.RSTStreamFrame); ok {
			t.Fatalf("stream reset after %d echoed bytes", got.Len())
		}
	}
	if !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Fatalf("echo of %d bytes differs from the %d sent", got.Len(), want.Len())
	}
	_ = cli.Close()
	<-served
	srv.wg.Wait()
}

// TestControlFloodClosesConnection: a client that keeps sending PINGs and
// never reads the acks loses its connection once 1 MiB of control frames
// is queued for it, counted; the server's memory for it stays bounded.
func TestControlFloodClosesConnection(t *testing.T) {
	srv, err := NewServer(ServerConfig{
		Identity: fuzzServer, Certs: noCerts{},
		Deliver: func(context.Context, spiffeid.ID, netip.AddrPort) (net.Conn, error) {
			return nil, errors.New("no delivery in this test")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	cli, _, pc, served := serveConn(t, srv, loopbackListener(t), false)
	defer cli.Close()
	// A small send buffer at the server, so that the acks the client does
	// not read pile up in the engine's queue soon rather than in the kernel.
	if err := pc.SetWriteBuffer(4096); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(cli, clientPreface); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Write(newFrames().settings().Bytes()); err != nil {
		t.Fatal(err)
	}
	pings := newFrames()
	for range 1024 {
		_ = pings.fr.WritePing(false, [8]byte{'f', 'l', 'o', 'o', 'd'})
	}
	burst := pings.Bytes()
	// 17 bytes per ack: 1 MiB queued is ~62k PINGs past what the socket
	// buffers hold. Stop at 100 MiB of PINGs: the server must have closed.
	var sent int
	for sent = 0; sent < 100<<20; sent += len(burst) {
		if _, err := cli.Write(burst); err != nil {
			break
		}
	}
	if sent >= 100<<20 {
		t.Fatalf("the server took %d bytes of PINGs without reading its acks and did not close", sent)
	}
	<-served
	if got := srv.Stats().ControlFloods; got != 1 {
		t.Fatalf("after %d bytes of PINGs: %d control floods counted, want 1 (connection closed for another reason?)", sent, got)
	}
	srv.wg.Wait()
}

// TestControlBudgetBoundsNode: clients that send PINGs and read none of the
// acks used to make each connection queue up to 1 MiB of them (1 GiB at the
// node's 1024 connections, as much again in the writes under way). The
// Budget's Control now bounds what all connections of the node hold beyond
// 16 KiB each (here 256 KiB, for 16 clients that each ask for ~590 KiB of
// acks): the heap grows by less than 4 MiB (before: ~9.4 MB of acks), the
// connections past the budget are closed as control floods, nothing stays
// charged once they are gone, and a client that reads still gets its acks.
func TestControlBudgetBoundsNode(t *testing.T) {
	budget, err := NewBudget(BudgetConfig{Control: 256 << 10})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(ServerConfig{
		Identity: fuzzServer, Certs: noCerts{}, Budget: budget,
		Deliver: func(context.Context, spiffeid.ID, netip.AddrPort) (net.Conn, error) {
			return nil, errors.New("no delivery in this test")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ln := loopbackListener(t)
	heap := func() uint64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	pings := newFrames()
	_ = pings.fr.WritePing(false, [8]byte{'f', 'l', 'o', 'o', 'd'})
	ping := pings.Bytes()
	const clients, acks = 16, 590 << 10 // below the connection's own 1 MiB
	burst := bytes.Repeat(ping, acks/len(ping))
	before := heap()
	type attacker struct {
		cli    *net.TCPConn
		pc     *plainConn
		served chan struct{}
		total  int64
	}
	var as []attacker
	for range clients {
		cli, _, pc, served := serveConn(t, srv, ln, false)
		// Small socket buffers: the acks pile up in the engine, not the kernel.
		if err := pc.SetWriteBuffer(4096); err != nil {
			t.Fatal(err)
		}
		if err := cli.SetReadBuffer(4096); err != nil {
			t.Fatal(err)
		}
		b := append([]byte(clientPreface), newFrames().settings().Bytes()...)
		b = append(b, burst...)
		if _, err := cli.Write(b); err != nil {
			t.Fatal(err)
		}
		as = append(as, attacker{cli, pc, served, int64(len(b))})
	}
	// Every PING read: each engine waits for more input, or closed.
	closed := func(ch chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	for _, a := range as {
		for a.pc.parked.Load() < a.total && !closed(a.served) {
			time.Sleep(time.Millisecond)
		}
	}
	during := heap()
	flooded := 0
	for _, a := range as {
		if closed(a.served) {
			flooded++
		}
	}
	if st := budget.Stats(); st.Control > 256<<10 {
		t.Errorf("control bytes charged = %d, over the budget's %d", st.Control, 256<<10)
	}
	t.Logf("live heap %d -> %d bytes with %d clients not reading %d bytes of acks each; %d closed", before, during, clients, acks, flooded)
	const bound = 4 << 20
	if during > before+bound {
		t.Errorf("live heap grew by %d bytes with %d clients not reading their acks, want < %d", during-before, clients, bound)
	}
	// On a loaded machine the wait above can outlast the 30 s write
	// deadline: a connection whose acks were not read is then closed by
	// it before its queue passes the budget. Either way it is closed and
	// counted.
	if st := srv.Stats(); flooded == 0 || st.ControlFloods+st.WriteTimeouts != uint64(flooded) || st.ControlFloods == 0 {
		t.Errorf("%d connections closed, %d control floods and %d write timeouts counted; want some closed as floods, each counted", flooded, st.ControlFloods, st.WriteTimeouts)
	}

	// A client that reads gets its ack.
	cli, _, _, _ := serveConn(t, srv, ln, false)
	b := append([]byte(clientPreface), newFrames().settings().Bytes()...)
	if _, err := cli.Write(append(b, ping...)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(nil, cli)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("reading client: no PING ack: %v", err)
		}
		if p, ok := f.(*http2.PingFrame); ok && p.IsAck() {
			break
		}
	}
	_ = cli.Close()
	for _, a := range as {
		_ = a.cli.Close()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = srv.Shutdown(ctx)
	srv.wg.Wait()
	if st := budget.Stats(); st.Control != 0 {
		t.Errorf("control bytes still charged after every connection closed: %d", st.Control)
	}
}
