package hbonetest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Sink serves on loopback until the test ends: each connection sends an
// 8-byte big-endian length n, then n bytes; the sink answers the count it
// read (8 bytes) and closes. The length prefix lets clients without
// CloseWrite (Istio's dialer returns a net.Pipe) wait for the count.
func Sink(tb testing.TB) netip.AddrPort {
	tb.Helper()
	return Serve(tb, func(c net.Conn) {
		var n int64
		if err := binary.Read(c, binary.BigEndian, &n); err != nil {
			return
		}
		got, _ := io.CopyN(io.Discard, c, n)
		_ = binary.Write(c, binary.BigEndian, got)
	})
}

// Source serves on loopback until the test ends: each connection sends an
// 8-byte big-endian length n; the source answers n bytes (whole 256 KiB
// writes, so n is rounded up to a multiple of 256 KiB) and keeps the
// connection open until the client closes it.
func Source(tb testing.TB) netip.AddrPort {
	tb.Helper()
	chunk := make([]byte, sourceChunk)
	return Serve(tb, func(c net.Conn) {
		var n int64
		if err := binary.Read(c, binary.BigEndian, &n); err != nil {
			return
		}
		for ; n > 0; n -= sourceChunk {
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
		_, _ = io.Copy(io.Discard, c)
	})
}

// sourceChunk is the size of Source's writes.
const sourceChunk = 256 << 10

// Download asks a Source behind c for b.N × 256 KiB, reads all of it and
// reports MB/s and cpu-ns/B (this process's CPU, as Throughput).
func Download(b *testing.B, c io.ReadWriter) {
	b.Helper()
	total := int64(b.N) * sourceChunk
	buf := make([]byte, sourceChunk)
	b.ResetTimer()
	start, cpu := time.Now(), CPUTime()
	if err := binary.Write(c, binary.BigEndian, total); err != nil {
		b.Fatal(err)
	}
	for got := int64(0); got < total; {
		n, err := c.Read(buf[:min(sourceChunk, total-got)])
		got += int64(n)
		if err != nil {
			b.Fatalf("failed after %d of %d bytes: %v", got, total, err)
		}
	}
	el, used := time.Since(start), CPUTime()-cpu
	b.StopTimer()
	b.ReportMetric(float64(total)/el.Seconds()/1e6, "MB/s")
	b.ReportMetric(float64(used.Nanoseconds())/float64(total), "cpu-ns/B")
}

// Echo serves on loopback until the test ends, echoing each connection until
// EOF.
func Echo(tb testing.TB) netip.AddrPort {
	tb.Helper()
	return Serve(tb, func(c net.Conn) { _, _ = io.Copy(c, c) })
}

// SendCounted writes the length prefix and n copies of chunk to c, then
// reads the sink's count and checks it.
func SendCounted(c io.ReadWriter, chunk []byte, n int) error {
	total := int64(n) * int64(len(chunk))
	if err := binary.Write(c, binary.BigEndian, total); err != nil {
		return fmt.Errorf("failed to write length %d: %w", total, err)
	}
	for range n {
		if _, err := c.Write(chunk); err != nil {
			return fmt.Errorf("failed to write chunk: %w", err)
		}
	}
	var got int64
	if err := binary.Read(c, binary.BigEndian, &got); err != nil {
		return fmt.Errorf("failed to read count: %w", err)
	}
	if got != total {
		return fmt.Errorf("sink got %d bytes, want %d", got, total)
	}
	return nil
}

// Serve runs handle for every connection to a loopback listener until the
// test ends; the connection is closed when handle returns, and at the end.
func Serve(tb testing.TB, handle func(net.Conn)) netip.AddrPort {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]struct{}{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				continue
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
					_ = c.Close()
				}()
				handle(c)
			}()
		}
	}()
	tb.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// CPUTime returns the user + system CPU time this process has used, for
// CPU-per-byte metrics that hold on a machine shared with other loads.
func CPUTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Throughput runs SendCounted of n chunks over c and reports MB/s and
// cpu-ns/B (this process's CPU: client, proxies and app together).
func Throughput(b *testing.B, c io.ReadWriter, chunk []byte) {
	b.Helper()
	b.ResetTimer()
	start, cpu := time.Now(), CPUTime()
	if err := SendCounted(c, chunk, b.N); err != nil {
		b.Fatal(err)
	}
	el, used := time.Since(start), CPUTime()-cpu
	b.StopTimer()
	bytes := float64(b.N) * float64(len(chunk))
	b.ReportMetric(bytes/el.Seconds()/1e6, "MB/s")
	b.ReportMetric(float64(used.Nanoseconds())/bytes, "cpu-ns/B")
}
