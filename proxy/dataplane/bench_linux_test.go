package dataplane_test

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/proxytest"
)

// benchDial connects from the client pod: "ours" is captured by the divert
// and proxied, "peer" carries the bypass mark and goes straight to the
// server (the direct path between the same two namespaces).
func benchDial(b *testing.B, e *env, mode string, dst netip.AddrPort) *net.TCPConn {
	dial := e.client.Dial
	if mode == "peer" {
		dial = func(ctx context.Context, dst netip.AddrPort) (*net.TCPConn, error) {
			return markedDial(ctx, e.client, dst)
		}
	}
	c, err := dial(context.Background(), dst)
	if err != nil {
		b.Fatal(err)
	}
	return c
}

// sink counts what it reads until EOF and answers the count. It reads in
// 1 MiB buffers (io.Discard would read 8 KiB at a time and make the sink,
// not the path, the bottleneck).
func sink(b *testing.B, p *proxytest.Pod, port uint16) {
	p.Handle(b, port, func(c net.Conn) {
		buf := make([]byte, 1<<20)
		var n int64
		for {
			k, err := c.Read(buf)
			n += int64(k)
			if err != nil {
				break
			}
		}
		_ = binary.Write(c, binary.BigEndian, n)
	})
}

// upload writes b.N chunks to c, half-closes, reads the sink's count,
// checks it and reports MB/s, cpu-ns/B (the CPU time of the whole
// process per byte moved) and kthread-ns/B (kernelThreadsCPU over the same
// window, per byte).
func upload(b *testing.B, c *net.TCPConn, chunk []byte) {
	kt := kernelThreadsCPU()
	b.ResetTimer()
	start, cpu := time.Now(), hbonetest.CPUTime()
	for range b.N {
		if _, err := c.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	_ = c.CloseWrite()
	var n int64
	if err := binary.Read(c, binary.BigEndian, &n); err != nil {
		b.Fatal(err)
	}
	el := time.Since(start)
	cpuEnd := hbonetest.CPUTime()
	b.StopTimer()
	ktNs := kernelThreadsCPUSince(kt)
	if n != int64(b.N*len(chunk)) {
		b.Fatalf("server got %d bytes, want %d", n, b.N*len(chunk))
	}
	b.ReportMetric(float64(n)/el.Seconds()/1e6, "MB/s")
	b.ReportMetric(float64((cpuEnd-cpu).Nanoseconds())/float64(n), "cpu-ns/B")
	b.ReportMetric(float64(ktNs)/float64(n), "kthread-ns/B")
}

// kernelThreadsCPU returns the CPU time (ns, from /proc/<pid>/schedstat) of
// every softirq thread (ksoftirqd/N) and kworker, by pid. Softirq work the
// kernel defers to ksoftirqd and sends done by kworkers are not charged to
// the process (no IRQ time accounting here), so cpu-ns/B misses them; these
// threads are machine-wide, so other loads show up in them too.
func kernelThreadsCPU() map[int]int64 {
	m := map[int]int64{}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return m
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile("/proc/" + e.Name() + "/comm")
		if err != nil || !isKernelWorker(comm) {
			continue
		}
		st, err := os.ReadFile("/proc/" + e.Name() + "/schedstat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(st))
		if len(f) == 0 {
			continue
		}
		if ns, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			m[pid] = ns
		}
	}
	return m
}

// isKernelWorker reports whether a thread's comm names a softirq thread or
// a kworker.
func isKernelWorker(comm []byte) bool {
	return bytes.HasPrefix(comm, []byte("ksoftirqd/")) || bytes.HasPrefix(comm, []byte("kworker/"))
}

// kernelThreadsCPUSince returns how much CPU time the threads of before
// that still run have used since (threads that came or went in between
// are left out).
func kernelThreadsCPUSince(before map[int]int64) int64 {
	var sum int64
	for pid, ns := range kernelThreadsCPU() {
		if was, ok := before[pid]; ok && ns >= was {
			sum += ns - was
		}
	}
	return sum
}

// BenchmarkProxyThroughput: bulk TCP from the client pod to the server pod,
// proxied (ours) against direct (peer), and through the splice floor relay
// (floor, splicefloor_linux_test.go: the same two TCP connections, no
// capture, blocking splice on threads of its own); MB/s, the CPU time per
// byte of the whole process (client, relay or proxy, and sink run in it for
// every path, and the kernel's work for the TCP connections is charged to
// them) and of the kernel's softirq threads and kworkers.
func BenchmarkProxyThroughput(b *testing.B) {
	e := setup(b, dataplane.Config{})
	sink(b, e.server, 9000)
	dst := netip.AddrPortFrom(e.server.IP4, 9000)
	floor := startSpliceFloor(b, e.client, dst)
	chunk := make([]byte, 256<<10)
	for _, mode := range []string{"ours", "peer", "floor"} {
		b.Run(mode, func(b *testing.B) {
			var c *net.TCPConn
			if mode == "floor" {
				var err error
				if c, err = markedDial(context.Background(), e.client, floor); err != nil {
					b.Fatal(err)
				}
			} else {
				c = benchDial(b, e, mode, dst)
			}
			defer c.Close()
			upload(b, c, chunk)
		})
	}
}

// BenchmarkHBONEProxyThroughput: bulk TCP from the client pod through both
// proxies to the server pod's app: over HBONE (ours: capture → mTLS HTTP/2
// to the server pod's :15008 → delivery) against today's plaintext proxied
// path (peer: the same WDS record without tunnel_protocol HBONE); MB/s and
// CPU time per byte of the whole process (both proxies, client and sink).
func BenchmarkHBONEProxyThroughput(b *testing.B) {
	e := setupHBONE(b)
	sink(b, e.server, 9000)
	dst := netip.AddrPortFrom(e.server.IP4, 9000)
	chunk := make([]byte, 256<<10)
	for _, mode := range []string{"ours", "peer"} {
		b.Run(mode, func(b *testing.B) {
			e.idx.Upsert(hboneWorkload(e.server, mode == "ours"))
			c, err := e.client.Dial(context.Background(), dst)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			upload(b, c, chunk)
		})
	}
}

// BenchmarkProxyConnect: connect plus a one-byte round trip from the client
// pod to the server pod, proxied (ours) against direct (peer); p50/p99.
func BenchmarkProxyConnect(b *testing.B) {
	e := setup(b, dataplane.Config{})
	e.server.Echo(b, 9001)
	dst := netip.AddrPortFrom(e.server.IP4, 9001)
	for _, mode := range []string{"ours", "peer"} {
		b.Run(mode, func(b *testing.B) {
			connectLatency(b, func() *net.TCPConn { return benchDial(b, e, mode, dst) })
		})
	}
}

// BenchmarkHBONERelayThroughput: bulk TCP from the client pod to the server
// pod's app over the same three TCP hops (app → source side → destination
// side → app): through both proxies over HBONE (ours) against the bare mTLS
// relay (peer, relay_linux_test.go: TLS 1.3 with the same SVIDs and cipher
// suite, 256 KiB copies, no HTTP/2), with the same relay sending the records
// of each chunk in one write(2) (relay-batched), a direct connection between
// the same pods (direct) and the AES-GCM seal + open cost per byte (aes-gcm)
// in the same run; MB/s and cpu-ns/B of the whole process.
func BenchmarkHBONERelayThroughput(b *testing.B) {
	e := setupHBONE(b)
	sink(b, e.server, 9000)
	dst := netip.AddrPortFrom(e.server.IP4, 9000)
	r := startRelay(b, e, dst, false)
	rb := startRelay(b, e, dst, true)
	chunk := make([]byte, 256<<10)
	for _, mode := range []string{"ours", "peer", "relay-batched", "direct", "aes-gcm"} {
		b.Run(mode, func(b *testing.B) {
			var c *net.TCPConn
			var err error
			switch mode {
			case "aes-gcm":
				benchAESGCM(b)
				return
			case "ours":
				c, err = e.client.Dial(context.Background(), dst)
			case "peer":
				c, err = markedDial(context.Background(), e.client, r.Addr)
			case "relay-batched":
				c, err = markedDial(context.Background(), e.client, rb.Addr)
			case "direct":
				c, err = markedDial(context.Background(), e.client, dst)
			}
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			upload(b, c, chunk)
		})
	}
}

// benchAESGCM seals b.N full TLS records (16 KiB of plaintext, the 5-byte
// record header as additional data) with AES-128-GCM, the suite HBONE
// negotiates (TestRelay), then opens one b.N times, and reports seal-ns/B,
// open-ns/B and their sum gcm-ns/B: what one byte costs in crypto across a
// tunnel. The times are the thread's CPU time (the goroutine is locked to
// it), so preemption by other loads does not count.
func benchAESGCM(b *testing.B) {
	aead, err := newAESGCM(make([]byte, 16))
	if err != nil {
		b.Fatal(err)
	}
	const record = 16 << 10
	plain := make([]byte, record)
	sealed := make([]byte, 0, record+aead.Overhead())
	nonce := make([]byte, aead.NonceSize())
	ad := []byte{23, 3, 3, 0, 0}
	binary.BigEndian.PutUint16(ad[3:], record+16)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.ResetTimer()
	t0 := threadCPU(b)
	for i := range b.N {
		binary.BigEndian.PutUint64(nonce[len(nonce)-8:], uint64(i))
		sealed = aead.Seal(sealed[:0], nonce, plain, ad)
	}
	t1 := threadCPU(b)
	for range b.N {
		if _, err := aead.Open(plain[:0], nonce, sealed, ad); err != nil {
			b.Fatal(err)
		}
	}
	t2 := threadCPU(b)
	b.StopTimer()
	n := float64(b.N) * record
	b.ReportMetric(float64(t1-t0)/n, "seal-ns/B")
	b.ReportMetric(float64(t2-t1)/n, "open-ns/B")
	b.ReportMetric(float64(t2-t0)/n, "gcm-ns/B")
}

// threadCPU returns the calling thread's CPU time in nanoseconds.
func threadCPU(b *testing.B) int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		b.Fatal(err)
	}
	return ts.Nano()
}

// newAESGCM returns AES-GCM with key (16 bytes: AES-128).
func newAESGCM(key []byte) (cipher.AEAD, error) {
	blk, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(blk)
}

// connectLatency runs b.N times: dial, a one-byte round trip, close with
// a reset (no TIME_WAIT pile-up), and reports p50 and p99.
func connectLatency(b *testing.B, dial func() *net.TCPConn) {
	lat := make([]time.Duration, 0, b.N)
	one := []byte{1}
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		c := dial()
		if _, err := c.Write(one); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, one); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		_ = c.SetLinger(0)
		_ = c.Close()
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}

// podDial dials dst from pod p for a benchmark.
func podDial(b *testing.B, p *proxytest.Pod, dst netip.AddrPort) *net.TCPConn {
	c, err := p.Dial(context.Background(), dst)
	if err != nil {
		b.Fatal(err)
	}
	return c
}
