// Command benchreport turns `go test -bench` output into the project's
// benchmark table: for each comparison (a benchmark with "ours" and "peer"
// sub-benchmarks) and each metric both report, it prints ours, peer, the
// ratio ours/peer, the goal from bench/goals/*.json and a verdict, and writes
// the same rows as JSON (results.json) with what the run was (run.json).
//
// Usage: go test -run '^$' -bench . ./... | go run ./tools/benchreport -goals bench/goals -out bench/out
//
// A benchmark that appears more than once (make bench BENCHCOUNT=N, or go
// test -count N) is reported as the median of each of its metrics.
//
// With -readme FILE it reads results.json and run.json from -out instead and
// rewrites the goal table of FILE between its benchreport marker lines
// (make bench-readme).
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"aether.io/node/tools/benchreport/report"
)

func main() {
	goalsDir := flag.String("goals", "bench/goals", "directory of *.json goal files")
	outDir := flag.String("out", "bench/out", "directory for results.json and run.json")
	in := flag.String("in", "-", "go test -bench output ('-' for stdin)")
	readme := flag.String("readme", "", "Markdown file whose goal table to rewrite from -out's results.json and run.json")
	var run report.Run
	flag.StringVar(&run.Commit, "commit", "", "the tree that ran (git describe), recorded in run.json")
	flag.StringVar(&run.Bench, "bench", "", "make bench's BENCH, recorded in run.json")
	flag.StringVar(&run.BenchTime, "benchtime", "", "make bench's BENCHTIME, recorded in run.json")
	flag.IntVar(&run.Rounds, "rounds", 0, "make bench's BENCHCOUNT, recorded in run.json")
	flag.StringVar(&run.Pkgs, "pkgs", "", "make bench's BENCHPKGS, recorded in run.json")
	flag.Parse()

	goals, err := report.LoadGoals(*goalsDir)
	if err != nil {
		fail(err)
	}
	if *readme != "" {
		if err := writeReadme(*readme, *outDir, goals); err != nil {
			fail(err)
		}
		return
	}

	var r io.Reader = os.Stdin
	if *in != "-" {
		f, err := os.Open(*in)
		if err != nil {
			fail(err)
		}
		defer f.Close()
		r = f
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		fail(err)
	}
	results, err := report.Parse(bytes.NewReader(raw))
	if err != nil {
		fail(err)
	}
	marks, err := report.ParseRun(bytes.NewReader(raw))
	if err != nil {
		fail(err)
	}
	run.Start, run.End, run.LoadMin, run.LoadMax, run.CPU, run.Procs = marks.Start, marks.End, marks.LoadMin, marks.LoadMax, marks.CPU, marks.Procs
	rows := report.Rows(results, goals)
	if err := report.PrintTable(os.Stdout, rows); err != nil {
		fail(err)
	}
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		fail(err)
	}
	if err := writeJSON(filepath.Join(*outDir, "results.json"), rows); err != nil {
		fail(err)
	}
	if err := writeJSON(filepath.Join(*outDir, "run.json"), run); err != nil {
		fail(err)
	}
}

// writeReadme rewrites path's goal table from outDir's results.json and
// run.json.
func writeReadme(path, outDir string, goals map[string]report.Goal) error {
	var rows []report.Row
	if err := readJSON(filepath.Join(outDir, "results.json"), &rows); err != nil {
		return err
	}
	var run report.Run
	if err := readJSON(filepath.Join(outDir, "run.json"), &run); err != nil {
		return err
	}
	var table bytes.Buffer
	if err := report.Markdown(&table, rows, goals, run); err != nil {
		return err
	}
	doc, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	out, err := report.WriteBetween(doc, table.Bytes())
	if err != nil {
		return fmt.Errorf("failed to place the table in %q: %w", path, err)
	}
	return os.WriteFile(path, out, 0o644)
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("failed to read %q (run make bench first): %w", path, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("failed to parse %q: %w", path, err)
	}
	return nil
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "benchreport:", err)
	os.Exit(1)
}
