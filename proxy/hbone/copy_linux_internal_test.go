package hbone

import (
	"bytes"
	"io"
	"net"
	"testing"
)

// counted wraps a socket as the data plane does: SocketConn, counting reads.
type counted struct {
	net.Conn
	read int
}

func (c *counted) Socket() net.Conn  { return c.Conn }
func (c *counted) SocketRead(n int)  { c.read += n }
func (c *counted) SocketWritten(int) {}

// embedded wraps a socket without SocketConn: its Read must be kept.
type embedded struct{ *net.TCPConn }

// TestCopyFromSocket: a socket (and a SocketConn over one) is copied by
// its raw reads until EOF, every byte observed; another wrapper is left to
// readChunks' Read; a socket closed under the copy is an error, not EOF.
func TestCopyFromSocket(t *testing.T) {
	src := make([]byte, 3<<20+123)
	for i := range src {
		src[i] = byte(i * 13)
	}
	for _, wrap := range []string{"socket", "SocketConn"} {
		t.Run(wrap, func(t *testing.T) {
			w, r := tcpPair(t)
			go func() {
				_, _ = w.Write(src)
				_ = w.CloseWrite()
			}()
			var from io.Reader = r
			c := &counted{Conn: r}
			if wrap == "SocketConn" {
				from = c
			}
			var got bytes.Buffer
			// With a frame header's room in front, as the server reads.
			done, err := copyFromSocket(from, frameHeaderLen, nil, func(b []byte) error {
				got.Write(b[frameHeaderLen:])
				return nil
			})
			if !done || err != nil {
				t.Fatalf("copyFromSocket = (%v, %v), want (true, nil)", done, err)
			}
			if !bytes.Equal(got.Bytes(), src) {
				t.Fatalf("copied %d bytes, differ from the %d sent", got.Len(), len(src))
			}
			if wrap == "SocketConn" && c.read != len(src) {
				t.Fatalf("SocketRead saw %d bytes, want %d", c.read, len(src))
			}
		})
	}
	t.Run("other wrapper", func(t *testing.T) {
		_, r := tcpPair(t)
		if done, err := copyFromSocket(embedded{r}, 0, nil, nil); done || err != nil {
			t.Fatalf("copyFromSocket = (%v, %v), want (false, nil)", done, err)
		}
	})
	t.Run("closed under the copy", func(t *testing.T) {
		w, r := tcpPair(t)
		if _, err := w.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		sink := func([]byte) error {
			_ = r.Close() // after the first read: the copy then waits on a closed socket
			return nil
		}
		go func() {
			_, err := copyFromSocket(r, 0, nil, sink)
			errc <- err
		}()
		if err := <-errc; err == nil {
			t.Fatal("copy of a socket closed under it ended without an error")
		}
	})
}
