// Package report parses `go test -bench` output and builds the comparison
// rows of the project's benchmark table (see docs/CONTRIBUTING.md).
package report

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Result is one benchmark: its full name, its metrics by unit and how many
// runs (`go test -count N`) they are the median of.
type Result struct {
	Name    string
	Metrics map[string]float64
	Runs    int
	// Samples are each metric's values in the order of the runs.
	Samples map[string][]float64
}

var procSuffix = regexp.MustCompile(`-\d+$`)

// Parse reads benchmark lines ("BenchmarkX/ours-2  10  123 ns/op  4 p50-ns").
// Other lines are ignored. The GOMAXPROCS suffix is dropped from names; when
// a name repeats (rounds of make bench BENCHCOUNT=N, -count N), each metric
// is the median of its values.
func Parse(r io.Reader) (map[string]Result, error) {
	samples := map[string]map[string][]float64{}
	runs := map[string]int{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		if _, err := strconv.ParseInt(f[1], 10, 64); err != nil {
			continue
		}
		name := procSuffix.ReplaceAllString(f[0], "")
		if samples[name] == nil {
			samples[name] = map[string][]float64{}
		}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("bad value %q in %q", f[i], sc.Text())
			}
			samples[name][f[i+1]] = append(samples[name][f[i+1]], v)
		}
		runs[name]++
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	out := make(map[string]Result, len(samples))
	for name, ms := range samples {
		res := Result{Name: name, Metrics: make(map[string]float64, len(ms)), Runs: runs[name], Samples: ms}
		for unit, vs := range ms {
			res.Metrics[unit] = median(slices.Clone(vs))
		}
		out[name] = res
	}
	return out, nil
}

// median of vs (the mean of the middle two for an even count); vs is
// sorted in place.
func median(vs []float64) float64 {
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// Goal is the judged metric of one comparison and the allowed ratio ours/peer.
type Goal struct {
	Metric   string   `json:"metric"`
	MaxRatio *float64 `json:"max_ratio,omitempty"`
	MinRatio *float64 `json:"min_ratio,omitempty"`
	// Peer names the sub-benchmark ours is judged against ("peer" when
	// empty), for a comparison whose named floor is another sub-benchmark
	// of the same run (for example "floor").
	Peer string `json:"peer,omitempty"`
	// Note says in a sentence or two what runs on each side and why that peer.
	Note string `json:"note,omitempty"`
	// Area is the goals file the goal comes from, without ".json".
	Area string `json:"-"`
}

// against is the sub-benchmark g judges ours against.
func (g Goal) against() string {
	if g.Peer == "" {
		return "peer"
	}
	return g.Peer
}

// LoadGoals reads every *.json in dir: objects mapping a comparison name
// (or a name prefix ending at a '/') to its Goal.
func LoadGoals(dir string) (map[string]Goal, error) {
	goals := map[string]Goal{}
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		var g map[string]Goal
		if err := json.Unmarshal(b, &g); err != nil {
			return nil, fmt.Errorf("failed to parse goals %q: %w", f, err)
		}
		for k, v := range g {
			if v.Metric == "" || (v.MaxRatio == nil && v.MinRatio == nil) {
				return nil, fmt.Errorf("goal %q in %q needs a metric and max_ratio or min_ratio", k, f)
			}
			v.Area = strings.TrimSuffix(filepath.Base(f), ".json")
			goals[k] = v
		}
	}
	return goals, nil
}

// Row is one line of the table.
type Row struct {
	Name   string `json:"name"`
	Metric string `json:"metric"`
	// Against is the sub-benchmark in the peer column: "peer", or the one
	// a goal names (Goal.Peer).
	Against string  `json:"against"`
	Ours    float64 `json:"ours"`
	Peer    float64 `json:"peer"`
	Ratio   float64 `json:"ratio"`
	// RatioMin and RatioMax are the least and greatest ratio of one run
	// of ours to the same run of the peer, when both ran more than once
	// and as often (make bench BENCHCOUNT=N: one pair per round).
	RatioMin float64 `json:"ratio_min,omitempty"`
	RatioMax float64 `json:"ratio_max,omitempty"`
	Goal     string  `json:"goal,omitempty"`
	Verdict  string  `json:"verdict"`
	// Runs is how many runs of ours the values are the median of.
	Runs int `json:"runs"`
}

// Rows pairs every "<name>/ours" with "<name>/peer" (and, when its goal
// names another sub-benchmark, with that one too) and emits one row per
// metric both report ("ns/op", "B/op" and "allocs/op" only when no custom
// metric exists). Benchmarks without a peer are listed with peer 0.
func Rows(results map[string]Result, goals map[string]Goal) []Row {
	var rows []Row
	for name, ours := range results {
		base, ok := strings.CutSuffix(name, "/ours")
		if !ok {
			continue
		}
		goal, hasGoal := findGoal(goals, base)
		against := []string{"peer"}
		if hasGoal && goal.against() != "peer" {
			if _, ok := results[base+"/"+goal.against()]; ok {
				against = append(against, goal.against())
			}
		}
		for _, a := range against {
			peer, hasPeer := results[base+"/"+a]
			for _, metric := range metrics(ours) {
				r := Row{Name: base, Metric: metric, Against: a, Ours: ours.Metrics[metric], Verdict: "info", Runs: ours.Runs}
				if hasPeer {
					p, ok := peer.Metrics[metric]
					if !ok {
						continue
					}
					r.Peer = p
					if p != 0 {
						r.Ratio = r.Ours / p
					}
					r.RatioMin, r.RatioMax = ratioRange(ours.Samples[metric], peer.Samples[metric])
				} else {
					r.Verdict = "no peer"
				}
				if hasGoal && goal.Metric == metric && goal.against() == a && hasPeer {
					r.Goal, r.Verdict = judge(goal, r.Ratio)
				}
				rows = append(rows, r)
			}
		}
	}
	slices.SortFunc(rows, func(a, b Row) int {
		if c := strings.Compare(a.Name, b.Name); c != 0 {
			return c
		}
		if c := strings.Compare(a.Against, b.Against); c != 0 {
			return c
		}
		return strings.Compare(a.Metric, b.Metric)
	})
	return rows
}

// ratioRange is the least and greatest ours[i]/peer[i] when both sides
// have more than one sample and the same number; else 0, 0.
func ratioRange(ours, peer []float64) (lo, hi float64) {
	if len(ours) < 2 || len(ours) != len(peer) {
		return 0, 0
	}
	for i := range ours {
		if peer[i] == 0 {
			return 0, 0
		}
		r := ours[i] / peer[i]
		if i == 0 || r < lo {
			lo = r
		}
		if i == 0 || r > hi {
			hi = r
		}
	}
	return lo, hi
}

func metrics(r Result) []string {
	var custom, std []string
	for m := range r.Metrics {
		switch m {
		case "ns/op", "B/op", "allocs/op":
			std = append(std, m)
		default:
			custom = append(custom, m)
		}
	}
	if len(custom) == 0 {
		custom = std
	}
	slices.Sort(custom)
	return custom
}

func findGoal(goals map[string]Goal, base string) (Goal, bool) {
	k, ok := goalKey(goals, base)
	return goals[k], ok
}

func judge(g Goal, ratio float64) (goal, verdict string) {
	verdict = "pass"
	var parts []string
	if g.MaxRatio != nil {
		parts = append(parts, "≤ "+bound(*g.MaxRatio)+"×")
		if ratio > *g.MaxRatio {
			verdict = "MISS"
		}
	}
	if g.MinRatio != nil {
		parts = append(parts, "≥ "+bound(*g.MinRatio)+"×")
		if ratio < *g.MinRatio {
			verdict = "MISS"
		}
	}
	return strings.Join(parts, " and "), verdict
}

// bound is a goal's ratio with at least two decimals and as many as it has
// (1.00, 0.95, 1.025).
func bound(v float64) string {
	s := strconv.FormatFloat(v, 'f', -1, 64)
	i := strings.IndexByte(s, '.')
	if i < 0 {
		return s + ".00"
	}
	return s + strings.Repeat("0", max(0, 2-(len(s)-i-1)))
}

// PrintTable writes rows as an aligned text table.
func PrintTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	var b strings.Builder
	b.WriteString("NAME\tMETRIC\tOURS\tPEER\tRATIO\tGOAL\tVERDICT\tRUNS\n")
	for _, r := range rows {
		name := r.Name
		if r.Against != "" && r.Against != "peer" {
			name += " (vs " + r.Against + ")"
		}
		fmt.Fprintf(&b, "%s\t%s\t%s\t%s\t%.3f\t%s\t%s\t%d\n", name, r.Metric, num(r.Ours), num(r.Peer), r.Ratio, r.Goal, r.Verdict, r.Runs)
	}
	if _, err := io.WriteString(tw, b.String()); err != nil {
		return err
	}
	return tw.Flush()
}

func num(v float64) string {
	switch {
	case v == 0:
		return "-"
	case v >= 1e6:
		return strconv.FormatFloat(v, 'e', 3, 64)
	default:
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
}
