package hbone_test

import (
	"io"
	"net"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

// tunnelCount is how many idle tunnels fit this process's open-file limit
// (each costs up to four sockets: stream or client, upstream, app), at most
// 10k; the limit is not raised (containers forbid raising the hard limit).
func tunnelCount(b *testing.B) int {
	b.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	return int(min(10_000, (lim.Cur-1000)/4))
}

// BenchmarkHBONEIdleTunnels: memory (heap + goroutine stacks, client,
// server and the app together) per idle tunnel with up to 10k open on one
// pooled connection (ours) vs as many idle direct TCP connections to the
// same app (peer); B/tunnel and MB/10k-tunnels (linear from the count used).
func BenchmarkHBONEIdleTunnels(b *testing.B) {
	tunnels := tunnelCount(b)
	e := newEnv(b, func(c *hbone.ServerConfig) { c.MaxConcurrentStreams = tunnels })
	d := hbonetest.NewDialer(b, e.certs)
	dst := hbonetest.Echo(b)
	for _, mode := range []string{"ours", "peer"} {
		b.Run(mode, func(b *testing.B) {
			var perTunnel float64
			for range b.N {
				before := inUse()
				conns := make([]net.Conn, 0, tunnels)
				for range tunnels {
					c := benchDial(b, mode, d, e.proxy, dst)
					conns = append(conns, c)
				}
				// One round trip on the last: every tunnel is established.
				one := []byte{1}
				if _, err := conns[len(conns)-1].Write(one); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(conns[len(conns)-1], one); err != nil {
					b.Fatal(err)
				}
				perTunnel = float64(inUse()-before) / float64(tunnels)
				for _, c := range conns {
					_ = c.Close()
				}
				// The server closes the upstreams asynchronously.
				waitFor(b, func() bool { return e.srv.Stats().StreamsActive == 0 })
			}
			b.ReportMetric(perTunnel, "B/tunnel")
			b.ReportMetric(perTunnel*10_000/1e6, "MB/10k-tunnels")
			b.ReportMetric(float64(tunnels), "tunnels")
			if mode == "ours" && d.Stats().ConnsOpened != 1 {
				b.Fatalf("connections = %d, want one pooled connection for %d tunnels", d.Stats().ConnsOpened, tunnels)
			}
		})
	}
}

func inUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse + m.StackInuse)
}
