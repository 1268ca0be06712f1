package proxy_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// waitCount waits, polling every 200 µs, until the process logged s n
// times, and returns when it saw that.
func (p *proxyProc) waitCount(tb testing.TB, s string, n int) time.Time {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for strings.Count(p.out.String(), s) < n {
		select {
		case <-p.done:
			tb.Fatalf("aether-proxy exited before it logged %q %d times:\n%s", s, n, p.out.String())
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("aether-proxy did not log %q %d times in 60 s:\n%s", s, n, p.out.String())
		}
		time.Sleep(200 * time.Microsecond)
	}
	return time.Now()
}

// BenchmarkProxyHandover: 100 captured pods served by aether-proxy; each
// op replaces the running process. ours: a successor takes the listeners
// over (-handover-socket), timed from its start to the old proxy
// accepting nothing (the successor's "hand-over done", logged once the old
// proxy answered done); the pods are served throughout. peer: today's
// stop-then-start, timed from SIGTERM of the running process
// (-shutdown-drain 0) to the new one serving all 100 pods: the gap in
// which no pod has a listener. Metric: the median op in ms.
func BenchmarkProxyHandover(b *testing.B) {
	const pods = 100
	names := make([]string, pods)
	for i := range names {
		names[i] = fmt.Sprintf("p%d", i)
	}
	e := newHandoverEnv(b, names...)
	const served = "pod listeners serving"
	b.Run("ours", func(b *testing.B) {
		cur := e.start(b, "-shutdown-drain", "0")
		cur.waitCount(b, served, pods)
		var ms []float64
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			start := time.Now()
			next := e.start(b, "-shutdown-drain", "0")
			done := next.waitCount(b, "hand-over done", 1)
			ms = append(ms, float64(done.Sub(start).Microseconds())/1e3)
			cur.waitExit(b, 30*time.Second)
			cur = next
		}
		b.StopTimer()
		b.ReportMetric(median(ms), "ms")
		cur.kill()
	})
	b.Run("peer", func(b *testing.B) {
		cur := startProxyProc(b, e.bin, e.ag.socket, "-log-level", "info", "-shutdown-drain", "0", "-flows-socket", e.flows)
		cur.waitCount(b, served, pods)
		var ms []float64
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			start := time.Now()
			cur.term(b)
			cur.waitExit(b, 30*time.Second)
			cur = startProxyProc(b, e.bin, e.ag.socket, "-log-level", "info", "-shutdown-drain", "0", "-flows-socket", e.flows)
			done := cur.waitCount(b, served, pods)
			ms = append(ms, float64(done.Sub(start).Microseconds())/1e3)
		}
		b.StopTimer()
		b.ReportMetric(median(ms), "ms")
		cur.kill()
	})
}

func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
