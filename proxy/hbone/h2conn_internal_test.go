package hbone

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/netip"
	"testing"

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
