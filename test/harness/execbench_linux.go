package harness

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"
)

// Verb is the CNI verb an exec benchmark times.
type Verb int

const (
	// VerbAdd times ADD; DEL runs untimed after it.
	VerbAdd Verb = iota
	// VerbDel times DEL; ADD runs untimed before it.
	VerbDel
)

// rssOps is how many extra operations ExecBench runs under GNU time, after
// the timed ones, to measure peak RSS.
const rssOps = 5

// ExecBench measures whole plugin processes as a container runtime runs
// them: b.N attachments through rt (whose executor is ex), each in a fresh
// pod netns made and removed outside the measurement, timing verb alone.
// pod describes the attachment for a netns path (and may prepare it, for
// example bind it in a fake control plane). It reports p50-ns and p99-ns
// of the timed verb, cpu-p50-ns (the median CPU time, user + system, of
// the verb's plugin processes: the measure that a busy machine distorts
// least), bin-bytes (the size of the binary at bin) and
// peak-rss-bytes: the median, over rssOps more operations run after the
// timed ones with ex.MeasureRSS, of the largest peak RSS among the plugin
// processes of the verb.
func ExecBench(b *testing.B, rt *Runtime, ex *RSSExec, bin string, verb Verb, pod func(netns string) Pod) {
	b.Helper()
	fi, err := os.Stat(bin)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := os.Stat(GNUTime); err != nil {
		b.Fatalf("peak RSS needs GNU time (Debian package time; make deps): %v", err)
	}
	lat := make([]time.Duration, 0, b.N)
	cpu := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		d, c, _ := execOp(b, rt, ex, verb, pod, true)
		lat = append(lat, d)
		cpu = append(cpu, c)
	}
	b.StopTimer()
	ex.MeasureRSS = true
	rss := make([]int64, 0, rssOps)
	for range rssOps {
		_, _, r := execOp(b, rt, ex, verb, pod, false)
		rss = append(rss, r)
	}
	ex.MeasureRSS = false
	slices.Sort(lat)
	slices.Sort(cpu)
	slices.Sort(rss)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[(len(lat)*99)/100].Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(cpu[len(cpu)/2].Nanoseconds()), "cpu-p50-ns")
	b.ReportMetric(float64(fi.Size()), "bin-bytes")
	b.ReportMetric(float64(rss[len(rss)/2]), "peak-rss-bytes")
}

// execOp runs one attachment in a fresh pod netns and returns how long
// verb took, its plugins' CPU time and the peak RSS ex recorded for it. With timed, the benchmark
// timer runs during verb only (it is stopped on entry and on return).
func execOp(b *testing.B, rt *Runtime, ex *RSSExec, verb Verb, pod func(netns string) Pod, timed bool) (time.Duration, time.Duration, int64) {
	ctx := context.Background()
	n, err := CreateNS("pod")
	if err != nil {
		b.Fatal(err)
	}
	p := pod(n.Path())
	if verb == VerbDel {
		if _, err := rt.Add(ctx, p); err != nil {
			_ = n.Remove()
			b.Fatalf("ADD: %v", err)
		}
	}
	ex.PeakRSS()
	ex.CPU()
	if timed {
		b.StartTimer()
	}
	start := time.Now()
	if verb == VerbAdd {
		_, err = rt.Add(ctx, p)
	} else {
		err = rt.Del(ctx, p)
	}
	d := time.Since(start)
	if timed {
		b.StopTimer()
	}
	rss, cpu := ex.PeakRSS(), ex.CPU()
	if err == nil && verb == VerbAdd {
		err = rt.Del(ctx, p)
	}
	if rerr := n.Remove(); err == nil {
		err = rerr
	}
	if err != nil {
		b.Fatal(err)
	}
	return d, cpu, rss
}
