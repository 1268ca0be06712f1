package harness

import (
	"slices"
	"testing"
	"time"
)

func TestInterleaveAlternatesWhichSideGoesFirst(t *testing.T) {
	var order []int
	out := interleave(4, 0, func(side int) execSample {
		order = append(order, side)
		return execSample{lat: time.Duration(len(order))}
	})
	if want := []int{0, 1, 1, 0, 0, 1, 1, 0}; !slices.Equal(order, want) {
		t.Fatalf("ran sides %v, want %v", order, want)
	}
	// Each side's samples in the order its ops ran.
	if got := []time.Duration{out[0][0].lat, out[0][1].lat, out[0][2].lat, out[0][3].lat}; !slices.Equal(got, []time.Duration{1, 4, 5, 8}) {
		t.Errorf("side 0's samples are %v, want [1 4 5 8]", got)
	}
	if got := []time.Duration{out[1][0].lat, out[1][1].lat, out[1][2].lat, out[1][3].lat}; !slices.Equal(got, []time.Duration{2, 3, 6, 7}) {
		t.Errorf("side 1's samples are %v, want [2 3 6 7]", got)
	}
}

// TestInterleaveSharesLoadDrift runs two sides whose ops cost 2 and 1
// units times a load that grows with (simulated) time, as other jobs'
// load drifts during a benchmark: their median latencies must still be in
// the ratio 2, which running one side's ops before the other's is not
// (the later side pays more of the drift).
func TestInterleaveSharesLoadDrift(t *testing.T) {
	const unit = time.Millisecond
	base := [2]time.Duration{2 * unit, unit}
	var now time.Duration
	out := interleave(0, 300*unit, func(side int) execSample {
		load := 1 + float64(now)/float64(200*unit)
		d := time.Duration(float64(base[side]) * load)
		now += d
		return execSample{lat: d}
	})
	if len(out[0]) != len(out[1]) || len(out[0])%2 != 0 || len(out[0]) < 2 {
		t.Fatalf("ran %d and %d ops, want as many of each, an even number", len(out[0]), len(out[1]))
	}
	var sum [2]time.Duration
	for side := range 2 {
		for _, s := range out[side] {
			sum[side] += s.lat
		}
	}
	if max(sum[0], sum[1]) < 300*unit || min(sum[0], sum[1]) >= 300*unit {
		t.Errorf("stopped with sides' totals %v and %v, want the first pair boundary after one reached 300ms", sum[0], sum[1])
	}
	median := func(s []execSample) float64 {
		l := make([]time.Duration, len(s))
		for i, v := range s {
			l[i] = v.lat
		}
		slices.Sort(l)
		return float64(l[len(l)/2])
	}
	if r := median(out[0]) / median(out[1]); r < 1.96 || r > 2.04 {
		t.Errorf("median ratio %.3f under a drifting load, want 2 within 2%%", r)
	}
}
