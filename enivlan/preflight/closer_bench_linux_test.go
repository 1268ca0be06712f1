package preflight

import (
	"slices"
	"syscall"
	"testing"
	"time"

	"aether.io/node/test/harness"
)

// BenchmarkExecCloser: a closer's whole life for one ADD's two packet
// sockets (ARP, IPv6) on lo in a netns: Start, Take, the plugin's end of the
// pair closes, the closer exits, paying the sockets' grace periods in its
// exit. life-p50-ns is Start to the closer's exit (reaped), cpu-p50-ns its
// user+system CPU (wait4), the work that competes with an ADD for the cores.
func BenchmarkExecCloser(b *testing.B) {
	harness.RequireRoot(b)
	n, lo := loopback(b)
	var life, cpu []time.Duration
	for b.Loop() {
		cl := NewExecCloser()
		start := time.Now()
		cl.Start()
		c := openBoth(b, n, lo, cl)
		if err := c.Close(); err != nil {
			b.Fatalf("Close: %v", err)
		}
		pid, err := cl.Started()
		if err != nil {
			b.Fatal(err)
		}
		if err := cl.Close(); err != nil {
			b.Fatal(err)
		}
		var ws syscall.WaitStatus
		var ru syscall.Rusage
		if _, err := syscall.Wait4(pid, &ws, 0, &ru); err != nil {
			b.Fatal(err)
		}
		if !ws.Exited() || ws.ExitStatus() != 0 {
			b.Fatalf("closer ended with %v", ws)
		}
		life = append(life, time.Since(start))
		cpu = append(cpu, time.Duration(ru.Utime.Nano()+ru.Stime.Nano()))
	}
	for name, d := range map[string][]time.Duration{"life-p50-ns": life, "cpu-p50-ns": cpu} {
		slices.Sort(d)
		b.ReportMetric(float64(d[len(d)/2].Nanoseconds()), name)
	}
}
