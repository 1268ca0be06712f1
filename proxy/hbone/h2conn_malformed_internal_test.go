package hbone

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestMalformedStreamsReset: what h2spec's cases of the same ids send
// (README.md, "Conformance"). Each request is a stream error: RST_STREAM
// PROTOCOL_ERROR on its stream, no response, and the connection stays up
// (a PING after it is answered); a well-formed CONNECT on the same
// connection is delivered.
func TestMalformedStreamsReset(t *testing.T) {
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
	ln := loopbackListener(t)
	connect := []string{":method", "CONNECT", ":authority", "127.0.0.1:5"}
	for _, tt := range []struct {
		name  string // the h2spec case
		write func(f *frames)
	}{
		{"http2/5.3.1/1 HEADERS depending on itself", func(f *frames) {
			f.hbuf.Reset()
			for i := 0; i < len(connect); i += 2 {
				_ = f.henc.WriteField(hpack.HeaderField{Name: connect[i], Value: connect[i+1]})
			}
			_ = f.fr.WriteHeaders(http2.HeadersFrameParam{
				StreamID: 1, BlockFragment: f.hbuf.Bytes(), EndHeaders: true,
				Priority: http2.PriorityParam{StreamDep: 1, Weight: 15},
			})
		}},
		{"http2/5.3.1/2 PRIORITY depending on itself", func(f *frames) {
			_ = f.fr.WritePriority(1, http2.PriorityParam{StreamDep: 1, Weight: 15})
		}},
		{"http2/8.1.2.2/1 connection-specific header", func(f *frames) {
			f.headers(1, false, append(connect, "connection", "keep-alive")...)
		}},
		{"http2/8.1.2.2/2 TE other than trailers", func(f *frames) {
			f.headers(1, false, append(connect, "te", "gzip")...)
		}},
		{"transfer-encoding", func(f *frames) { f.headers(1, false, append(connect, "transfer-encoding", "chunked")...) }},
		{"upgrade", func(f *frames) { f.headers(1, false, append(connect, "upgrade", "websocket")...) }},
		{"keep-alive", func(f *frames) { f.headers(1, false, append(connect, "keep-alive", "timeout=5")...) }},
		{"proxy-connection", func(f *frames) { f.headers(1, false, append(connect, "proxy-connection", "close")...) }},
		{"GET with a connection-specific header", func(f *frames) {
			f.headers(1, true, ":method", "GET", ":scheme", "https", ":path", "/", ":authority", "x", "connection", "close")
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cli, _, _, served := serveConn(t, srv, ln, false)
			defer func() {
				_ = cli.Close()
				<-served
			}()
			f := newFrames().settings()
			tt.write(f)
			_ = f.fr.WritePing(false, [8]byte{'a', 'f', 't', 'e', 'r'})
			f.connect(3, portTCP, true)
			if _, err := io.WriteString(cli, clientPreface); err != nil {
				t.Fatal(err)
			}
			if _, err := cli.Write(f.Bytes()); err != nil {
				t.Fatal(err)
			}
			if got, want := readStreamOutcomes(t, cli, 3), "1:RST_STREAM PROTOCOL_ERROR ping 3:200"; got != want {
				t.Fatalf("server answered %q, want %q", got, want)
			}
		})
	}
	t.Run("TE trailers is allowed", func(t *testing.T) {
		cli, _, _, served := serveConn(t, srv, ln, false)
		defer func() {
			_ = cli.Close()
			<-served
		}()
		f := newFrames().settings().headers(1, true, append(connect, "te", "trailers")...)
		_ = f.fr.WritePing(false, [8]byte{})
		f.connect(3, portTCP, true)
		if _, err := io.WriteString(cli, clientPreface); err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Write(f.Bytes()); err != nil {
			t.Fatal(err)
		}
		got := readStreamOutcomes(t, cli, 1, 3)
		if got != "ping 1:200 3:200" && got != "ping 3:200 1:200" {
			t.Fatalf("server answered %q, want both CONNECTs delivered (200)", got)
		}
	})
}

// readStreamOutcomes reads what the server sends until every stream of
// until has its answer: per stream the first answer ("id:status" or
// "id:RST_STREAM code"), "ping" for the PING ack, or a GOAWAY.
func readStreamOutcomes(t *testing.T, cli net.Conn, until ...uint32) string {
	t.Helper()
	fr := http2.NewFramer(nil, cli)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var out string
	seen := map[uint32]bool{}
	add := func(s string) {
		if out != "" {
			out += " "
		}
		out += s
	}
	answered := func() bool {
		for _, id := range until {
			if !seen[id] {
				return false
			}
		}
		return true
	}
	for !answered() {
		fm, err := fr.ReadFrame()
		if err != nil {
			add(fmt.Sprintf("read error: %v", err))
			return out
		}
		switch fm := fm.(type) {
		case *http2.MetaHeadersFrame:
			if !seen[fm.StreamID] {
				seen[fm.StreamID] = true
				add(fmt.Sprintf("%d:%s", fm.StreamID, fm.PseudoValue("status")))
			}
		case *http2.RSTStreamFrame:
			if !seen[fm.StreamID] {
				seen[fm.StreamID] = true
				add(fmt.Sprintf("%d:RST_STREAM %s", fm.StreamID, fm.ErrCode))
			}
		case *http2.PingFrame:
			add("ping")
		case *http2.GoAwayFrame:
			add("GOAWAY " + fm.ErrCode.String())
			return out
		}
	}
	return out
}
