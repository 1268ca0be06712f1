package dataplane_test

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/flowserver"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// flowsSubscriber serves m's flows on a socket of its own and connects one
// client to it, which sends its request, reads the answer and then reads
// nothing more (read false: its queue fills, then every event is dropped)
// or everything (read true: every event is formatted and written), counting
// the events it got or was told were dropped (seen). Both end with the
// benchmark.
func flowsSubscriber(b *testing.B, m *telemetry.Metrics, read bool) (seen *atomic.Int64) {
	b.Helper()
	ln, err := flowserver.Listen(filepath.Join(b.TempDir(), "flows", "flows.sock"))
	if err != nil {
		b.Fatal(err)
	}
	srv := flowserver.New(m.Flows(), flowserver.Options{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	c, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	if _, err := io.WriteString(c, "{}\n"); err != nil {
		b.Fatal(err)
	}
	dec := json.NewDecoder(c)
	var answer flowapi.Message
	if err := dec.Decode(&answer); err != nil || answer.Type != flowapi.TypeSubscribed {
		b.Fatalf("flows answer %+v, %v", answer, err)
	}
	seen = &atomic.Int64{}
	reading := make(chan struct{})
	go func() {
		defer close(reading)
		for read {
			var msg flowapi.Message
			if dec.Decode(&msg) != nil {
				return
			}
			if msg.Type == flowapi.TypeDropped {
				seen.Add(int64(msg.Dropped))
			} else {
				seen.Add(1)
			}
		}
	}()
	b.Cleanup(func() {
		_ = c.Close()
		<-reading
		srv.Close()
		if err := <-served; err != nil {
			b.Errorf("flows server: %v", err)
		}
	})
	return seen
}

// flowsEnv is a client and server pod pair (telemetryEnv, no access log)
// with a flows subscriber of mode: "off" (none), "unread" (one that never
// reads, its queue already full) or "read" (one that reads everything).
// closed is the connections run so far (connectRounds' count); seen the
// subscriber's count of events (flowsSubscriber).
func flowsEnv(b *testing.B, mode string) (e *env, m *telemetry.Metrics, closed int, seen *atomic.Int64) {
	e, m = telemetryEnv(b, false)
	if mode == "off" {
		return e, m, 0, nil
	}
	seen = flowsSubscriber(b, m, mode == "read")
	if mode == "unread" {
		// Two events a connection (the source side's open and close):
		// run until the queue and the socket's buffers are full.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for sum(m, "aether_proxy_flow_events_dropped_total", nil) == 0 {
			if ctx.Err() != nil {
				b.Fatal("the unread subscriber's queue never filled")
			}
			connectRounds(b, e, m, 100, float64(closed+100), nil)
			closed += 100
		}
	}
	return e, m, closed, seen
}

// BenchmarkConnectFlows: the CPU time of the whole process per proxied
// connection (connect plus a one-byte round trip, as
// BenchmarkConnectTelemetry) with a flows subscriber over the socket that
// never reads (ours: its queue full before the timer starts, so every
// event is dropped and counted) against no subscriber (peer); the goal is
// within noise (bench/goals/proxy.json). Each runs on its own pods;
// BenchmarkConnectFlowsAB alternates them, and a subscriber that reads.
func BenchmarkConnectFlows(b *testing.B) {
	for _, mode := range []string{"peer", "ours"} {
		b.Run(mode, func(b *testing.B) {
			flows := map[string]string{"peer": "off", "ours": "unread"}[mode]
			e, m, closed, _ := flowsEnv(b, flows)
			b.ResetTimer()
			used := connectRounds(b, e, m, b.N, float64(closed+b.N), nil)
			b.StopTimer()
			b.ReportMetric(float64(used.Nanoseconds())/float64(b.N), "cpu-ns/conn")
		})
	}
}

// BenchmarkConnectFlowsAB is BenchmarkConnectFlows with three pod pairs
// up at once, no subscriber (off), one that never reads (unread) and one
// that reads everything (read), alternated in blocks of 100 connections so
// the machine's drift falls on all three: cpu-ns/conn (a read block's
// until its reader has every event, so none of its cost falls on the next
// block) and the p50 and p99 of each connection's latency, their ratios to
// off, and the share of the unread subscriber's events dropped while timed
// (1: every one).
func BenchmarkConnectFlowsAB(b *testing.B) {
	const block = 100
	modes := []string{"off", "unread", "read"}
	envs := make([]*env, len(modes))
	ms := make([]*telemetry.Metrics, len(modes))
	closed := make([]int, len(modes))
	seen := make([]*atomic.Int64, len(modes))
	for i, mode := range modes {
		envs[i], ms[i], closed[i], seen[i] = flowsEnv(b, mode)
	}
	droppedBefore := sum(ms[1], "aether_proxy_flow_events_dropped_total", nil)
	cpu := make([]time.Duration, len(modes))
	lat := make([][]time.Duration, len(modes))
	n := 0
	b.ResetTimer()
	for ; n < b.N; n += block {
		for i, mode := range modes {
			start := hbonetest.CPUTime()
			connectRounds(b, envs[i], ms[i], block, float64(closed[i]+block), &lat[i])
			closed[i] += block
			if mode == "read" {
				// Two events a connection, the source side's open and
				// close.
				want := int64(2 * closed[i])
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				err := proxytest.WaitFor(ctx, func() bool { return seen[i].Load() >= want })
				cancel()
				if err != nil {
					b.Fatalf("the reading subscriber has %d of %d events", seen[i].Load(), want)
				}
			}
			cpu[i] += hbonetest.CPUTime() - start
		}
	}
	b.StopTimer()
	cpuPer := func(i int) float64 { return float64(cpu[i].Nanoseconds()) / float64(n) }
	quantile := func(i, q int) float64 {
		slices.Sort(lat[i])
		return float64(lat[i][len(lat[i])*q/100].Nanoseconds())
	}
	for i, mode := range modes {
		b.ReportMetric(cpuPer(i), mode+"-cpu-ns/conn")
		b.ReportMetric(quantile(i, 50), mode+"-p50-ns")
		b.ReportMetric(quantile(i, 99), mode+"-p99-ns")
		if i > 0 {
			b.ReportMetric(cpuPer(i)/cpuPer(0), mode+"/off-cpu")
			b.ReportMetric(quantile(i, 50)/quantile(0, 50), mode+"/off-p50")
		}
	}
	dropped := sum(ms[1], "aether_proxy_flow_events_dropped_total", nil) - droppedBefore
	b.ReportMetric(dropped/float64(2*n), "unread-dropped/event")
}
