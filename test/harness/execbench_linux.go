package harness

import (
	"context"
	"flag"
	"os"
	"slices"
	"strconv"
	"strings"
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

// rssOps is how many extra pairs of operations ExecBench runs under GNU
// time, after the timed ones, to measure peak RSS.
const rssOps = 5

// ExecSide is one side of an exec benchmark: the runtime that execs its
// plugins (RT, whose executor is Ex), its main plugin's binary (Bin) and
// the attachment for a pod netns path (Pod, which may prepare it, for
// example bind it in a fake control plane).
type ExecSide struct {
	RT  *Runtime
	Ex  *RSSExec
	Bin string
	Pod func(netns string) Pod
}

// execSample is one operation of an exec benchmark: how long the verb
// took, its plugin processes' CPU time and the peak RSS recorded for it.
type execSample struct {
	lat, cpu time.Duration
	rss      int64
}

// ExecBench measures whole plugin processes as a container runtime runs
// them, ours against peer in the same time window: each op attaches a pod
// in a fresh netns made and removed outside the measurement and times
// verb alone, and the ops run in pairs, one of each side, the side that
// goes first alternating from pair to pair, so a burst of load from other
// jobs lands on both sides alike. One untimed pair warms both sides up.
// -benchtime Nx runs N pairs; a duration runs pairs (an even number) until
// the slower side's timed ops add up to it. Then the sub-benchmarks "ours"
// and "peer" report their side's samples (see reportExec). go test's
// -count repeats sub-benchmarks, not their parent, so it repeats the same
// report: independent rounds are separate runs (make bench's -rounds).
func ExecBench(b *testing.B, verb Verb, ours, peer ExecSide) {
	b.Helper()
	if _, err := os.Stat(GNUTime); err != nil {
		b.Fatalf("peak RSS needs GNU time (Debian package time; make deps): %v", err)
	}
	sides := [2]ExecSide{ours, peer}
	var bins [2]int64
	for i, s := range sides {
		fi, err := os.Stat(s.Bin)
		if err != nil {
			b.Fatal(err)
		}
		bins[i] = fi.Size()
	}
	op := func(side int) execSample { return execOp(b, sides[side], verb) }
	op(0)
	op(1)
	n, d := benchTime()
	timed := interleave(n, d, op)
	for _, s := range sides {
		s.Ex.MeasureRSS = true
	}
	rss := interleave(rssOps, 0, op)
	for _, s := range sides {
		s.Ex.MeasureRSS = false
	}
	for i, name := range []string{"ours", "peer"} {
		b.Run(name, func(b *testing.B) { reportExec(b, bins[i], timed[i], rss[i]) })
	}
}

// benchTime returns what -test.benchtime asks for: a count of iterations
// ("100x": 100 and 0) or a duration (0 and it; 1s when unset or unparsed).
func benchTime() (int, time.Duration) {
	f := flag.Lookup("test.benchtime")
	if f == nil {
		return 0, time.Second
	}
	v := f.Value.String()
	if c, ok := strings.CutSuffix(v, "x"); ok {
		if n, err := strconv.Atoi(c); err == nil && n > 0 {
			return n, 0
		}
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return 0, d
	}
	return 0, time.Second
}

// interleave runs op(0) and op(1) in pairs, side 0 first in even pairs and
// side 1 first in odd ones, and returns each side's samples in order: n
// pairs when n > 0, else an even number of pairs, at least two, until
// either side's latencies add up to d.
func interleave(n int, d time.Duration, op func(side int) execSample) [2][]execSample {
	var out [2][]execSample
	var sum [2]time.Duration
	done := func(pair int) bool {
		if n > 0 {
			return pair >= n
		}
		return pair >= 2 && pair%2 == 0 && max(sum[0], sum[1]) >= d
	}
	for pair := 0; !done(pair); pair++ {
		for j := range 2 {
			side := (pair + j) % 2
			s := op(side)
			out[side] = append(out[side], s)
			sum[side] += s.lat
		}
	}
	return out
}

// reportExec reports one side's samples as its sub-benchmark's result,
// which measures nothing itself: p50-ns and p99-ns of the timed verb,
// cpu-p50-ns (the median CPU time, user + system, of the verb's plugin
// processes: the measure that a busy machine distorts least), bin-bytes
// (the size of the main plugin's binary) and peak-rss-bytes (the median,
// over the rss ops, of the largest peak RSS among the verb's plugin
// processes); ns/op is the mean latency. go test calls it again with a
// growing b.N until its (nearly empty) timer fills -benchtime, so the
// iteration count it prints is go test's ramp-up, not the number of ops
// (setting b.N would break that ramp-up); each call reports the same.
func reportExec(b *testing.B, bin int64, timed, rss []execSample) {
	lat := make([]time.Duration, len(timed))
	cpu := make([]time.Duration, len(timed))
	var total time.Duration
	for i, s := range timed {
		lat[i], cpu[i] = s.lat, s.cpu
		total += s.lat
	}
	peak := make([]int64, len(rss))
	for i, s := range rss {
		peak[i] = s.rss
	}
	slices.Sort(lat)
	slices.Sort(cpu)
	slices.Sort(peak)
	b.ReportMetric(float64(total.Nanoseconds())/float64(len(timed)), "ns/op")
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[(len(lat)*99)/100].Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(cpu[len(cpu)/2].Nanoseconds()), "cpu-p50-ns")
	b.ReportMetric(float64(bin), "bin-bytes")
	b.ReportMetric(float64(peak[len(peak)/2]), "peak-rss-bytes")
}

// execOp runs one attachment of side in a fresh pod netns and returns how
// long verb took, its plugins' CPU time and the peak RSS side's executor
// recorded for it (with MeasureRSS).
func execOp(b *testing.B, side ExecSide, verb Verb) execSample {
	ctx := context.Background()
	rt, ex := side.RT, side.Ex
	n, err := CreateNS("pod")
	if err != nil {
		b.Fatal(err)
	}
	p := side.Pod(n.Path())
	if verb == VerbDel {
		if _, err := rt.Add(ctx, p); err != nil {
			_ = n.Remove()
			b.Fatalf("ADD: %v", err)
		}
	}
	ex.PeakRSS()
	ex.CPU()
	start := time.Now()
	if verb == VerbAdd {
		_, err = rt.Add(ctx, p)
	} else {
		err = rt.Del(ctx, p)
	}
	s := execSample{lat: time.Since(start)}
	s.rss, s.cpu = ex.PeakRSS(), ex.CPU()
	if err == nil && verb == VerbAdd {
		err = rt.Del(ctx, p)
	}
	if rerr := n.Remove(); err == nil {
		err = rerr
	}
	if err != nil {
		b.Fatal(err)
	}
	return s
}
