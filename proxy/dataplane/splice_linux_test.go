package dataplane

import (
	"bytes"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tcpPairLoopback returns the two ends of a TCP connection on loopback.
func tcpPairLoopback(t *testing.T) (a, b *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() { c, _ := l.Accept(); acc <- c }()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-acc
	if s == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// TestSplicePipeOnlyWhileInFlight: a splice copy moves the bytes intact,
// counts them when the connection goes idle, gives its pipe back to the
// pool then (an idle connection holds none) and ends at EOF.
func TestSplicePipeOnlyWhileInFlight(t *testing.T) {
	var pool pipePool
	defer pool.close()
	srcW, srcR := tcpPairLoopback(t) // the copy reads srcR
	dstW, dstR := tcpPairLoopback(t) // and writes dstW
	counted := make(chan int64, 64)
	done := make(chan error, 1)
	go func() {
		_, err := pool.splice(dstW, srcR, func(n int64) { counted <- n })
		done <- err
	}()
	msg := bytes.Repeat([]byte("0123456789abcdef"), 4096+3) // 64 KiB + 48 B
	got := make([]byte, len(msg))
	for round := range 3 {
		if _, err := srcW.Write(msg); err != nil {
			t.Fatal(err)
		}
		_ = dstR.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(dstR, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("round %d: bytes changed on the way", round)
		}
		// Idle now: everything is counted and the pipe is back in the pool.
		var n int64
		deadline := time.After(10 * time.Second)
		for n < int64(len(msg)) {
			select {
			case k := <-counted:
				n += k
			case <-deadline:
				t.Fatalf("round %d: %d bytes counted, want %d", round, n, len(msg))
			}
		}
		if n != int64(len(msg)) {
			t.Fatalf("round %d: %d bytes counted, want %d", round, n, len(msg))
		}
		for pool.idle() != 1 {
			select {
			case <-deadline:
				t.Fatalf("round %d: pool holds %d pipes while the connection is idle, want 1", round, pool.idle())
			case <-time.After(time.Millisecond):
			}
		}
	}
	_ = srcW.CloseWrite()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("copy ended with %v, want EOF (nil)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("copy did not end at EOF")
	}
}

// TestSpliceUnixSocket: the inbound delivery's unix socket is spliced both
// ways like a TCP socket (TCP → unix, unix → TCP), not copied.
func TestSpliceUnixSocket(t *testing.T) {
	var pool pipePool
	defer pool.close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var us [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "unix")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		us[i] = c.(*net.UnixConn)
		defer c.Close()
	}
	msg := bytes.Repeat([]byte("unix"), 50<<10)
	for _, dir := range []struct {
		name     string
		dst, src syscall.Conn
		w        io.WriteCloser
		r        io.Reader
	}{
		{"tcp to unix", us[0], nil, nil, us[1]},
		{"unix to tcp", nil, us[1], us[0], nil},
	} {
		t.Run(dir.name, func(t *testing.T) {
			a, b := tcpPairLoopback(t)
			if dir.src == nil { // TCP source: write a, splice b
				dir.src, dir.w = b, a
			} else { // TCP destination: splice into a, read b
				dir.dst, dir.r = a, b
			}
			done := make(chan error, 1)
			var n int64
			go func() {
				_, err := pool.splice(dir.dst, dir.src, func(k int64) { n += k })
				done <- err
			}()
			go func() { _, _ = dir.w.Write(msg) }()
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(dir.r, got); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatal("bytes changed on the way")
			}
			if c, ok := dir.w.(interface{ CloseWrite() error }); ok {
				_ = c.CloseWrite()
			}
			if err := <-done; err != nil {
				t.Fatalf("splice = %v, want a clean EOF (no fallback)", err)
			}
			if n != int64(len(msg)) {
				t.Errorf("counted %d bytes, want %d", n, len(msg))
			}
		})
	}
}

// TestSpliceFallsBackWithoutPipes: with no pipe to be had (EMFILE) the
// copy goes on through a buffer: every byte arrives and is counted, EOF
// ends it cleanly.
func TestSpliceFallsBackWithoutPipes(t *testing.T) {
	pool := pipePool{newPipe: func() (*splicePipe, error) { return nil, unix.EMFILE }}
	srcW, srcR := tcpPairLoopback(t)
	dstW, dstR := tcpPairLoopback(t)
	msg := bytes.Repeat([]byte("fallback"), 32<<10)
	var counted int64
	done := make(chan error, 1)
	go func() {
		n, err := copyConn(&pool, dstW, srcR, func(k int64) { counted += k })
		if err == nil && n != int64(len(msg)) {
			t.Errorf("copyConn = %d bytes, want %d", n, len(msg))
		}
		done <- err
	}()
	go func() { _, _ = srcW.Write(msg); _ = srcW.CloseWrite() }()
	got := make([]byte, len(msg))
	_ = dstR.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(dstR, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("bytes changed on the way")
	}
	if err := <-done; err != nil {
		t.Fatalf("copy = %v, want a clean EOF", err)
	}
	if counted != int64(len(msg)) {
		t.Errorf("counted %d bytes, want %d", counted, len(msg))
	}
}
