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
