package report

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// Run says what one `make bench` ran and where: the Makefile's variables,
// the time and 1-minute load average it wrote at each round's start and at
// the end ("aether-bench round=1 time=<RFC 3339> load=0.42"), and the CPU and
// GOMAXPROCS go test printed.
type Run struct {
	// Commit is the tree that ran (git describe --tags --always --dirty).
	Commit    string    `json:"commit,omitempty"`
	Bench     string    `json:"bench,omitempty"`
	BenchTime string    `json:"benchtime,omitempty"`
	Rounds    int       `json:"rounds,omitempty"`
	Pkgs      string    `json:"pkgs,omitempty"`
	Start     time.Time `json:"start,omitzero"`
	End       time.Time `json:"end,omitzero"`
	LoadMin   float64   `json:"load_min,omitempty"`
	LoadMax   float64   `json:"load_max,omitempty"`
	CPU       string    `json:"cpu,omitempty"`
	Procs     int       `json:"procs,omitempty"`
}

// ParseRun reads the run's marks from make bench's raw output; lines that
// are not marks, a "cpu:" line or a benchmark line are ignored.
func ParseRun(r io.Reader) (Run, error) {
	var run Run
	loads := 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "aether-bench "):
			for _, kv := range strings.Fields(line)[1:] {
				k, v, _ := strings.Cut(kv, "=")
				switch k {
				case "time":
					t, err := time.Parse(time.RFC3339, v)
					if err != nil {
						return Run{}, fmt.Errorf("bad time %q in %q: %w", v, line, err)
					}
					if run.Start.IsZero() || t.Before(run.Start) {
						run.Start = t
					}
					if t.After(run.End) {
						run.End = t
					}
				case "load":
					l, err := strconv.ParseFloat(v, 64)
					if err != nil {
						return Run{}, fmt.Errorf("bad load %q in %q: %w", v, line, err)
					}
					if loads == 0 || l < run.LoadMin {
						run.LoadMin = l
					}
					if loads == 0 || l > run.LoadMax {
						run.LoadMax = l
					}
					loads++
				}
			}
		case strings.HasPrefix(line, "cpu: ") && run.CPU == "":
			run.CPU = strings.TrimSpace(strings.TrimPrefix(line, "cpu: "))
		case strings.HasPrefix(line, "Benchmark") && run.Procs == 0:
			if m := procSuffix.FindString(strings.Fields(line)[0]); m != "" {
				run.Procs, _ = strconv.Atoi(m[1:])
			}
		}
	}
	return run, sc.Err()
}

// Command is the make invocation that reproduces run, naming only the
// variables that differ from the Makefile's defaults (a '$' in BENCH
// doubled, as make needs it on its command line).
func (run Run) Command() string {
	parts := []string{"make bench"}
	if run.Bench != "" && run.Bench != "." {
		parts = append(parts, "BENCH='"+strings.ReplaceAll(run.Bench, "$", "$$")+"'")
	}
	if run.BenchTime != "" && run.BenchTime != "1s" {
		parts = append(parts, "BENCHTIME="+run.BenchTime)
	}
	if run.Rounds > 1 {
		parts = append(parts, "BENCHCOUNT="+strconv.Itoa(run.Rounds))
	}
	if run.Pkgs != "" && run.Pkgs != "./..." {
		parts = append(parts, "BENCHPKGS='"+run.Pkgs+"'")
	}
	return strings.Join(parts, " ")
}
