package vm

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"aether.io/node/test/harness"
)

// Suite is a whole test package run in one VM with this module's commands
// and the reference CNI plugins in AETHER_CNI_BIN_DIR.
type Suite struct {
	// Package is the test package, relative to the module root (for example
	// "./enivlan/e2e").
	Package string
	// Commands are this module's commands built into the bin directory
	// (names under ./cmd, for example "eni-vlan").
	Commands []string
	// Options are passed to Run; TestBinary and BinDir are filled in, and
	// Args default to -test.v -test.count=1 with a -test.timeout slightly
	// shorter than Options.Timeout.
	Options Options
}

// RunSuite checks that the suite package exists, builds its commands and
// the reference plugins statically, compiles the suite, boots one VM and
// runs it. It fails the test when the package has no tests (never skips),
// when the suite exits non-zero, or when any test in it skipped; the caller
// checks which tests passed with Result.Verdicts.
func RunSuite(tb testing.TB, s Suite) Result {
	tb.Helper()
	dir := filepath.Join(harness.ModuleRoot(), filepath.FromSlash(strings.TrimPrefix(s.Package, "./")))
	if m, _ := filepath.Glob(filepath.Join(dir, "*_test.go")); len(m) == 0 {
		tb.Fatalf("VM lane: the suite package %s has no tests (no *_test.go in %s): there is nothing to run in the VM", s.Package, dir)
	}
	binDir := tb.TempDir()
	for _, c := range s.Commands {
		if _, err := os.Stat(filepath.Join(harness.ModuleRoot(), "cmd", c)); err != nil {
			tb.Fatalf("VM lane: command ./cmd/%s does not exist: %v", c, err)
		}
	}
	if len(s.Commands) > 0 {
		pkgs := make([]string, len(s.Commands))
		for i, c := range s.Commands {
			pkgs[i] = "./cmd/" + c
		}
		BuildStatic(tb, binDir, pkgs...)
	}
	ref := harness.ReferencePlugins(tb)
	ents, err := os.ReadDir(ref)
	if err != nil {
		tb.Fatal(err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		if _, err := os.Stat(filepath.Join(binDir, e.Name())); err == nil {
			continue // this module's command of the same name wins
		}
		if err := os.Symlink(filepath.Join(ref, e.Name()), filepath.Join(binDir, e.Name())); err != nil {
			tb.Fatal(err)
		}
	}
	o := s.Options
	if o.Timeout == 0 {
		o.Timeout = 20 * time.Minute
	}
	if o.Args == nil {
		o.Args = []string{"-test.v", "-test.count=1", "-test.timeout=" + (o.Timeout - o.Timeout/10).String()}
	}
	o.TestBinary = CompileTest(tb, s.Package)
	o.BinDir = binDir
	res := Run(tb, o)
	res.Assert(tb)
	var skipped []string
	for name, v := range res.Verdicts() {
		if v == "SKIP" {
			skipped = append(skipped, name)
		}
	}
	sort.Strings(skipped)
	if len(skipped) > 0 {
		tb.Errorf("VM lane: tests skipped in the VM (the lane must run them all): %v", skipped)
	}
	return res
}
