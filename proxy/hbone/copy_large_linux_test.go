package hbone

import (
	"bytes"
	"runtime"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

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
