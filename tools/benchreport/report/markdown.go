package report

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// The lines around the generated table in a Markdown file (the README):
// WriteBetween replaces what lies between them and keeps both.
const (
	BeginMarker = "<!-- benchreport:begin: `make bench-readme` writes this table from bench/out; do not edit -->"
	EndMarker   = "<!-- benchreport:end -->"
)

// Markdown writes one table line per goal: the judged row of the run when
// there is one (every row, for a goal keyed by a name prefix), else "not
// run"; then a paragraph naming the run. Rows are judged again against
// goals as they are now, so a restated goal reads on the last measurement.
func Markdown(w io.Writer, rows []Row, goals map[string]Goal, run Run) error {
	var b strings.Builder
	b.WriteString("| area | benchmark | metric | ours | peer | ratio (rounds' range) | goal | verdict |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, key := range goalOrder(goals) {
		g := goals[key]
		found := false
		for _, r := range rows {
			if k, ok := goalKey(goals, r.Name); !ok || k != key || r.Metric != g.Metric || against(r) != g.against() || r.Peer == 0 {
				continue
			}
			found = true
			goal, verdict := judge(g, r.Ratio)
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n",
				g.Area, benchCell(r.Name, g), g.Metric, value(g.Metric, r.Ours), value(g.Metric, r.Peer), ratioCell(r), goal, verdictCell(verdict))
		}
		if !found {
			goal, _ := judge(g, math.NaN())
			fmt.Fprintf(&b, "| %s | %s | %s | — | — | — | %s | not run |\n", g.Area, benchCell(key, g), g.Metric, goal)
		}
	}
	b.WriteString("\n")
	b.WriteString(runSentence(run))
	b.WriteString("\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteBetween returns doc with everything between BeginMarker's line and
// EndMarker's line replaced by body.
func WriteBetween(doc, body []byte) ([]byte, error) {
	begin := bytes.Index(doc, []byte(BeginMarker+"\n"))
	end := bytes.Index(doc, []byte(EndMarker))
	if begin < 0 || end < 0 || end < begin {
		return nil, errors.New("no " + BeginMarker + " line followed by " + EndMarker)
	}
	start := begin + len(BeginMarker) + 1
	var out bytes.Buffer
	out.Write(doc[:start])
	out.Write(body)
	out.Write(doc[end:])
	return out.Bytes(), nil
}

// goalOrder is the goals' keys by area, then name.
func goalOrder(goals map[string]Goal) []string {
	keys := make([]string, 0, len(goals))
	for k := range goals {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if c := strings.Compare(goals[a].Area, goals[b].Area); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	return keys
}

// goalKey is the key of base's goal: base itself, else the longest key
// that is a prefix of base ending at a '/'.
func goalKey(goals map[string]Goal, base string) (string, bool) {
	if _, ok := goals[base]; ok {
		return base, true
	}
	best := ""
	for k := range goals {
		if strings.HasPrefix(base, k+"/") && len(k) > len(best) {
			best = k
		}
	}
	return best, best != ""
}

// against is the row's peer sub-benchmark; rows written before Row.Against
// existed compared with "peer".
func against(r Row) string {
	if r.Against == "" {
		return "peer"
	}
	return r.Against
}

func benchCell(name string, g Goal) string {
	if g.against() != "peer" {
		return "`" + name + "` vs `" + g.against() + "`"
	}
	return "`" + name + "`"
}

func ratioCell(r Row) string {
	s := strconv.FormatFloat(r.Ratio, 'f', 3, 64) + "×"
	if r.RatioMax > 0 {
		s += fmt.Sprintf(" (%.2f–%.2f)", r.RatioMin, r.RatioMax)
	}
	return s
}

func verdictCell(v string) string {
	if v == "MISS" {
		return "**MISS**"
	}
	return v
}

// value renders v in the metric's unit for a reader: durations in ns, µs
// or ms, bytes in kB or MB, rates and counts with three significant digits.
func value(metric string, v float64) string {
	switch {
	case metric == "ns/op" || strings.HasSuffix(metric, "-ns") || strings.HasPrefix(metric, "cpu-ns/"):
		unit := ""
		if i := strings.Index(metric, "/"); i >= 0 && metric != "ns/op" {
			unit = metric[i:]
		}
		return duration(v) + unit
	case strings.HasSuffix(metric, "-ms"):
		return sig(v) + " ms"
	case strings.HasSuffix(metric, "-B") || strings.HasSuffix(metric, "-bytes"):
		return scaled(v, "MB", "kB", "B")
	case metric == "MB/s":
		return sig(v) + " MB/s"
	}
	return sig(v)
}

func duration(ns float64) string { return scaled(ns, "ms", "µs", "ns") }

// scaled is v in the unit of its size: mega at 1e6 and above, kilo at 1e3,
// else one.
func scaled(v float64, mega, kilo, one string) string {
	switch {
	case v >= 1e6:
		return sig(v/1e6) + " " + mega
	case v >= 1e3:
		return sig(v/1e3) + " " + kilo
	}
	return sig(v) + " " + one
}

// sig is v with three significant digits, never in exponent form.
func sig(v float64) string {
	if v == 0 {
		return "0"
	}
	digits := 3 - int(math.Floor(math.Log10(math.Abs(v)))) - 1
	if digits < 0 {
		digits = 0
	}
	return strconv.FormatFloat(v, 'f', digits, 64)
}

func runSentence(run Run) string {
	var b strings.Builder
	b.WriteString("Measured by `" + run.Command() + "`")
	if run.Rounds > 1 {
		fmt.Fprintf(&b, " (each figure the median of %d rounds; a round runs ours, then the peer, once each)", run.Rounds)
	}
	if run.Commit != "" {
		b.WriteString(" on " + run.Commit)
	}
	if !run.Start.IsZero() {
		fmt.Fprintf(&b, ", %s–%s UTC", run.Start.UTC().Format("2006-01-02 15:04"), run.End.UTC().Format("15:04"))
	}
	if run.CPU != "" {
		b.WriteString(", " + run.CPU)
	}
	if run.Procs > 0 {
		fmt.Fprintf(&b, " with GOMAXPROCS %d", run.Procs)
	}
	if run.LoadMax > 0 {
		fmt.Fprintf(&b, ", 1-minute load average %.1f–%.1f at the rounds' starts and end (the machine is shared)", run.LoadMin, run.LoadMax)
	}
	b.WriteString(". A goal the run did not include reads \"not run\".")
	return b.String()
}
