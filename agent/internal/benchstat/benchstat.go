// Package benchstat collects per-operation latencies in benchmarks and
// reports p50/p99 with testing.B.ReportMetric, the metric names
// tools/benchreport reads.
package benchstat

import (
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// Latencies is a concurrency-safe list of durations.
type Latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

// Add records one latency.
func (l *Latencies) Add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, d)
	l.mu.Unlock()
}

// Report sets p50-ns and p99-ns on b.
func (l *Latencies) Report(b *testing.B) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.d) == 0 {
		return
	}
	s := slices.Clone(l.d)
	slices.Sort(s)
	b.ReportMetric(float64(s[len(s)*50/100]), "p50-ns")
	b.ReportMetric(float64(s[min(len(s)-1, len(s)*99/100)]), "p99-ns")
}

// DiskDir returns a fresh directory on a real disk for fsync benchmarks
// ($AETHER_BENCH_DIR, else /var/tmp), removed in b.Cleanup.
func DiskDir(b *testing.B) string {
	b.Helper()
	base := os.Getenv("AETHER_BENCH_DIR")
	if base == "" {
		base = "/var/tmp"
	}
	d, err := os.MkdirTemp(base, "aether-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(d) })
	return filepath.Clean(d)
}
