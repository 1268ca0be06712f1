package hbone

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (a, b *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// counted wraps a socket as the data plane does: SocketConn, counting reads.
type counted struct {
	net.Conn
	read int
}

func (c *counted) Socket() net.Conn { return c.Conn }
func (c *counted) SocketRead(n int) { c.read += n }

// embedded wraps a socket without SocketConn: its Read must be kept.
type embedded struct{ *net.TCPConn }

// TestCopyFromSocket: a socket (and a SocketConn over one) is copied by
// its raw reads until EOF, every byte observed; another wrapper is left to
// copyAdaptive's Read; a socket closed under the copy is an error, not EOF.
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
			done, err := copyFromSocket(&got, from, nil)
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
		if done, err := copyFromSocket(io.Discard, embedded{r}, nil); done || err != nil {
			t.Fatalf("copyFromSocket = (%v, %v), want (false, nil)", done, err)
		}
	})
	t.Run("closed under the copy", func(t *testing.T) {
		w, r := tcpPair(t)
		if _, err := w.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		flush := func() error {
			_ = r.Close() // after the first read: the copy then waits on a closed socket
			return nil
		}
		go func() {
			_, err := copyFromSocket(io.Discard, r, flush)
			errc <- err
		}()
		if err := <-errc; err == nil {
			t.Fatal("copy of a socket closed under it ended without an error")
		}
	})
}

// writeSizes records the size of every Write (and is no io.ReaderFrom).
type writeSizes struct {
	buf   bytes.Buffer
	sizes []int
}

func (w *writeSizes) Write(p []byte) (int, error) {
	w.sizes = append(w.sizes, len(p))
	return w.buf.Write(p)
}

// TestCopyLargeWrites: Copy hands a stream what a socket holds in writes
// larger than io.Copy's 32 KiB (what the data plane's outbound copy used to
// make), and copies every byte.
func TestCopyLargeWrites(t *testing.T) {
	w, r := tcpPair(t)
	if err := r.SetReadBuffer(1 << 20); err != nil {
		t.Fatal(err)
	}
	src := make([]byte, 192<<10)
	for i := range src {
		src[i] = byte(i * 7)
	}
	if _, err := w.Write(src); err != nil {
		t.Fatal(err)
	}
	if err := w.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	// Wait until all of it is in r's receive queue.
	rc, err := r.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	for queued := 0; queued < len(src); {
		var ierr error
		if err := rc.Control(func(fd uintptr) { queued, ierr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil || ierr != nil {
			t.Fatal(err, ierr)
		}
		runtime.Gosched()
	}
	var got writeSizes
	if err := Copy(&got, r); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.buf.Bytes(), src) {
		t.Fatalf("copied %d bytes, differ from the %d sent", got.buf.Len(), len(src))
	}
	if m := slices.Max(got.sizes); m <= 32<<10 {
		t.Fatalf("largest write %d bytes (writes %v), want more than 32 KiB", m, got.sizes)
	}
}
