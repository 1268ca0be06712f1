package report

import (
	"strings"
	"testing"
)

const sample = `goos: linux
BenchmarkAdd/ours-2         	     100	  1200000 ns/op	   900000 p50-ns	  1500000 p99-ns
BenchmarkAdd/peer-2         	     100	  2400000 ns/op	  1800000 p50-ns	  2000000 p99-ns
BenchmarkTput/1k/ours-2     	      10	        5 MB/s
BenchmarkTput/1k/peer-2     	      10	       10 MB/s
BenchmarkSolo-2             	      10	      100 ns/op
PASS
`

func TestRowsAndVerdicts(t *testing.T) {
	res, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	one, half := 1.0, 0.5
	goals := map[string]Goal{
		"BenchmarkAdd":  {Metric: "p50-ns", MaxRatio: &one},
		"BenchmarkTput": {Metric: "MB/s", MinRatio: &half},
	}
	rows := Rows(res, goals)
	got := map[string]Row{}
	for _, r := range rows {
		got[r.Name+" "+r.Metric] = r
	}
	if r := got["BenchmarkAdd p50-ns"]; r.Ratio != 0.5 || r.Verdict != "pass" {
		t.Errorf("p50 row: %+v", r)
	}
	if r := got["BenchmarkAdd p99-ns"]; r.Verdict != "info" || r.Ratio != 0.75 {
		t.Errorf("p99 row: %+v", r)
	}
	if r := got["BenchmarkTput/1k MB/s"]; r.Ratio != 0.5 || r.Verdict != "pass" {
		t.Errorf("prefix goal row: %+v", r)
	}
	if _, ok := got["BenchmarkAdd ns/op"]; ok {
		t.Error("ns/op must not be listed when custom metrics exist")
	}
	two := 2.0
	goals["BenchmarkTput"] = Goal{Metric: "MB/s", MinRatio: &two}
	for _, r := range Rows(res, goals) {
		if r.Name == "BenchmarkTput/1k" && r.Verdict != "MISS" {
			t.Errorf("throughput below goal must be a MISS: %+v", r)
		}
	}
}

// TestMedianOfRuns: a benchmark run -count N times is reported as the
// median of each metric, with the number of runs.
func TestMedianOfRuns(t *testing.T) {
	const runs = `BenchmarkT/ours-2  1  900 MB/s  2.0 cpu-ns/B
BenchmarkT/peer-2  1  1000 MB/s  1.0 cpu-ns/B
BenchmarkT/ours-2  1  500 MB/s  9.0 cpu-ns/B
BenchmarkT/peer-2  1  1200 MB/s  1.5 cpu-ns/B
BenchmarkT/ours-2  1  800 MB/s  2.5 cpu-ns/B
BenchmarkT/peer-2  1  1100 MB/s  1.2 cpu-ns/B
BenchmarkE/ours-2  1  10 MB/s
BenchmarkE/ours-2  1  30 MB/s
`
	res, err := Parse(strings.NewReader(runs))
	if err != nil {
		t.Fatal(err)
	}
	if r := res["BenchmarkT/ours"]; r.Metrics["MB/s"] != 800 || r.Metrics["cpu-ns/B"] != 2.5 || r.Runs != 3 {
		t.Errorf("ours: %+v, want MB/s 800, cpu-ns/B 2.5, 3 runs", r)
	}
	if r := res["BenchmarkE/ours"]; r.Metrics["MB/s"] != 20 || r.Runs != 2 {
		t.Errorf("even count: %+v, want the mean of the middle two (20)", r)
	}
	half := 0.5
	rows := Rows(res, map[string]Goal{"BenchmarkT": {Metric: "MB/s", MinRatio: &half}})
	for _, r := range rows {
		if r.Name == "BenchmarkT" && r.Metric == "MB/s" && (r.Ours != 800 || r.Peer != 1100 || r.Runs != 3 || r.Verdict != "pass") {
			t.Errorf("row of medians: %+v", r)
		}
	}
}
