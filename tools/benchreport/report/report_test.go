package report

import (
	"path/filepath"
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

// TestGoalPeer: a goal that names another sub-benchmark judges ours against
// it; the rows against "peer" stay, informational; per-round ratios give
// the range.
func TestGoalPeer(t *testing.T) {
	const runs = `BenchmarkP/ours-2   1  900 MB/s
BenchmarkP/peer-2   1  1800 MB/s
BenchmarkP/floor-2  1  1000 MB/s
BenchmarkP/ours-2   1  1000 MB/s
BenchmarkP/peer-2   1  2000 MB/s
BenchmarkP/floor-2  1  1000 MB/s
`
	res, err := Parse(strings.NewReader(runs))
	if err != nil {
		t.Fatal(err)
	}
	min := 0.95
	rows := Rows(res, map[string]Goal{"BenchmarkP": {Metric: "MB/s", MinRatio: &min, Peer: "floor"}})
	if len(rows) != 2 {
		t.Fatalf("got %d rows, want one against peer and one against floor: %+v", len(rows), rows)
	}
	floor, peer := rows[0], rows[1]
	if floor.Against != "floor" || floor.Ratio != 0.95 || floor.Verdict != "pass" || floor.RatioMin != 0.9 || floor.RatioMax != 1.0 {
		t.Errorf("row against floor: %+v", floor)
	}
	if peer.Against != "peer" || peer.Verdict != "info" || peer.Goal != "" || peer.Ratio != 0.5 {
		t.Errorf("row against peer: %+v", peer)
	}
}

func TestParseRun(t *testing.T) {
	const raw = `aether-bench round=1 time=2026-12-03T13:46:34Z load=3.66
goos: linux
cpu: Intel(R) Xeon(R) Processor
BenchmarkA/ours-2         	     128	   8051342 ns/op
aether-bench round=2 time=2026-12-03T13:47:21Z load=7.54
aether-bench end time=2026-12-03T13:51:02Z load=5.10
`
	run, err := ParseRun(strings.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	if run.Start.Format("15:04:05") != "13:46:34" || run.End.Format("15:04:05") != "13:51:02" ||
		run.LoadMin != 3.66 || run.LoadMax != 7.54 || run.CPU != "Intel(R) Xeon(R) Processor" || run.Procs != 2 {
		t.Errorf("run: %+v", run)
	}
	run.Bench, run.Rounds, run.Pkgs = "^BenchmarkA$", 3, "./a"
	if got, want := run.Command(), "make bench BENCH='^BenchmarkA$$' BENCHCOUNT=3 BENCHPKGS='./a'"; got != want {
		t.Errorf("Command() = %q, want %q", got, want)
	}
}

// TestMarkdown: one line per goal, measured or "not run", judged against
// the goal as it is now; the table replaces only what lies between the
// markers.
func TestMarkdown(t *testing.T) {
	one, two := 1.0, 2.5
	goals := map[string]Goal{
		"BenchmarkExec": {Metric: "p50-ns", MaxRatio: &two, Area: "b"},
		"BenchmarkTput": {Metric: "MB/s", MinRatio: &one, Peer: "floor", Area: "a"},
	}
	rows := []Row{
		{Name: "BenchmarkExec", Metric: "p50-ns", Against: "peer", Ours: 6.35e6, Peer: 2.99e6, Ratio: 2.1237, RatioMin: 1.9, RatioMax: 2.35, Goal: "≤ 1.00×", Verdict: "MISS"},
		{Name: "BenchmarkExec", Metric: "p99-ns", Against: "peer", Ours: 9e6, Peer: 3e6, Ratio: 3, Verdict: "info"},
	}
	var b strings.Builder
	if err := Markdown(&b, rows, goals, Run{Rounds: 3, Procs: 2, Commit: "8c7bef6"}); err != nil {
		t.Fatal(err)
	}
	want := "| area | benchmark | metric | ours | peer | ratio (rounds' range) | goal | verdict |\n" +
		"| --- | --- | --- | --- | --- | --- | --- | --- |\n" +
		"| a | `BenchmarkTput` vs `floor` | MB/s | — | — | — | ≥ 1.00× | not run |\n" +
		"| b | `BenchmarkExec` | p50-ns | 6.35 ms | 2.99 ms | 2.124× (1.90–2.35) | ≤ 2.50× | pass |\n"
	if got := b.String(); !strings.HasPrefix(got, want) || !strings.Contains(got, "`make bench BENCHCOUNT=3` (each figure the median of 3 rounds; a round runs ours, then the peer, once each) on 8c7bef6") {
		t.Errorf("Markdown:\n%s\nwant it to start with:\n%s", got, want)
	}

	doc := "# x\n" + BeginMarker + "\nold\n" + EndMarker + "\nafter\n"
	out, err := WriteBetween([]byte(doc), []byte("new\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(out), "# x\n"+BeginMarker+"\nnew\n"+EndMarker+"\nafter\n"; got != want {
		t.Errorf("WriteBetween:\n%s\nwant:\n%s", got, want)
	}
	if _, err := WriteBetween([]byte("# no markers\n"), nil); err == nil {
		t.Error("WriteBetween without markers must fail")
	}
}

func TestBound(t *testing.T) {
	for v, want := range map[float64]string{1: "1.00", 0.5: "0.50", 0.95: "0.95", 1.025: "1.025", 2: "2.00"} {
		if got := bound(v); got != want {
			t.Errorf("bound(%v) = %q, want %q", v, got, want)
		}
	}
}

func TestValue(t *testing.T) {
	for _, c := range []struct {
		metric string
		v      float64
		want   string
	}{
		{"p50-ns", 10_970_000, "11.0 ms"},
		{"p50-ns", 831_000, "831 µs"},
		{"cpu-ns/conn", 41_300, "41.3 µs/conn"},
		{"p50-ms", 10.1, "10.1 ms"},
		{"heap-B", 52_800_000, "52.8 MB"},
		{"MB/s", 1632.4, "1632 MB/s"},
		{"records/s", 19_812, "19812"},
		{"etcd-keys/node/min", 0.5, "0.500"},
	} {
		if got := value(c.metric, c.v); got != c.want {
			t.Errorf("value(%q, %v) = %q, want %q", c.metric, c.v, got, c.want)
		}
	}
}

// TestGoalFiles: the project's goal files load, and each note is a sentence
// or two (what runs on each side and why that peer); measurements and their
// history belong in docs/perf/.
func TestGoalFiles(t *testing.T) {
	goals, err := LoadGoals(filepath.Join("..", "..", "..", "bench", "goals"))
	if err != nil {
		t.Fatal(err)
	}
	if len(goals) == 0 {
		t.Fatal("no goals in bench/goals")
	}
	for k, g := range goals {
		if g.Note == "" || len(g.Note) > 450 {
			t.Errorf("goal %s (bench/goals/%s.json): note of %d characters; say in one or two sentences what runs on each side and why that peer (history goes to docs/perf/)", k, g.Area, len(g.Note))
		}
	}
}
