// Command benchreport turns `go test -bench` output into the project's
// benchmark table: for each comparison (a benchmark with "ours" and "peer"
// sub-benchmarks) and each metric both report, it prints ours, peer, the
// ratio ours/peer, the goal from bench/goals/*.json and a verdict, and writes
// the same rows as JSON.
//
// Usage: go test -run '^$' -bench . ./... | go run ./tools/benchreport -goals bench/goals -out bench/out
//
// A benchmark that appears more than once (make bench BENCHCOUNT=N, or go
// test -count N) is reported as the median of each of its metrics.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"aether.io/node/tools/benchreport/report"
)

func main() {
	goalsDir := flag.String("goals", "bench/goals", "directory of *.json goal files")
	outDir := flag.String("out", "bench/out", "directory for results.json")
	in := flag.String("in", "-", "go test -bench output ('-' for stdin)")
	flag.Parse()

	var r io.Reader = os.Stdin
	if *in != "-" {
		f, err := os.Open(*in)
		if err != nil {
			fail(err)
		}
		defer f.Close()
		r = f
	}
	results, err := report.Parse(r)
	if err != nil {
		fail(err)
	}
	goals, err := report.LoadGoals(*goalsDir)
	if err != nil {
		fail(err)
	}
	rows := report.Rows(results, goals)
	if err := report.PrintTable(os.Stdout, rows); err != nil {
		fail(err)
	}
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		fail(err)
	}
	b, err := json.MarshalIndent(rows, "", "  ")
	if err != nil {
		fail(err)
	}
	if err := os.WriteFile(*outDir+"/results.json", b, 0o644); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "benchreport:", err)
	os.Exit(1)
}
