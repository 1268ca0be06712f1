package demo

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/test/harness"
	"aether.io/node/test/vm"
)

// DemoCommands are this module's commands the demo runs; OptionalCommands
// are built when their package exists (the demo reports them missing).
var (
	DemoCommands     = []string{"eni-vlan", "aether-cni", "aether-agent", "aether-proxy"}
	OptionalCommands = []string{"aetherctl"}
)

// VMModules are the kernel modules the demo needs on top of
// vm.DefaultModules: the capture divert's TPROXY and fib expressions, and
// xfrm_user, because pkg/capture opens its netlink handle with every
// family (NETLINK_XFRM included) and the guest has no modprobe to load it
// on demand.
var VMModules = []string{"nft_tproxy", "nft_fib_inet", "xfrm_user"}

// TestNodeDemoInVM builds the demo's binaries and the reference plugins
// statically, compiles this package's tests, boots one qemu VM (test/vm,
// Debian's kernel with 802.1Q) and runs TestNodeDemo and
// TestNodeDemoTeardownOnSignal there. It prints the demo's report and
// asserts TEST-EXIT 0, both tests passing, every outcome line and the final
// PASS line.
func TestNodeDemoInVM(t *testing.T) {
	if os.Getenv(InVMEnv) == "1" {
		t.Skip("already inside the VM")
	}
	harness.RequireRoot(t)
	start := time.Now()
	binDir := t.TempDir()
	pkgs := make([]string, 0, len(DemoCommands))
	for _, c := range DemoCommands {
		pkgs = append(pkgs, "./cmd/"+c)
	}
	for _, c := range OptionalCommands {
		if _, err := os.Stat(filepath.Join(harness.ModuleRoot(), "cmd", c)); err == nil {
			pkgs = append(pkgs, "./cmd/"+c)
		} else {
			t.Logf("cmd/%s does not exist yet: the demo in the VM will report it missing", c)
		}
	}
	vm.BuildStatic(t, binDir, pkgs...)
	ref := harness.ReferencePlugins(t)
	for _, name := range []string{"host-local", "static"} {
		if err := os.Symlink(filepath.Join(ref, name), filepath.Join(binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	bin := vm.CompileTest(t, "./test/demo")
	built := time.Since(start)
	timeout := 8 * time.Minute
	res := vm.Run(t, vm.Options{
		TestBinary: bin,
		Args:       []string{"-test.v", "-test.count=1", "-test.run=^(TestNodeDemo|TestNodeDemoTeardownOnSignal)$", "-test.timeout=" + (timeout - time.Minute).String()},
		BinDir:     binDir,
		Modules:    VMModules,
		Memory:     1024,
		CPUs:       2,
		Timeout:    timeout,
		Quiet:      true,
	})
	fmt.Print(ExtractReport(res.Output))
	fmt.Printf("VM lane: build %v, boot to /init %v, boot to TEST-EXIT %v, total %v\n",
		built.Round(100*time.Millisecond), res.Boot.Round(100*time.Millisecond), res.Total.Round(100*time.Millisecond),
		time.Since(start).Round(100*time.Millisecond))
	if res.ExitCode != 0 {
		// The report says why outcomes failed; show the rest of the guest's
		// output after it (test verdicts, leak check), or the whole console
		// when the demo ended without a report.
		if i := strings.Index(res.Output, "DEMO RESULT: "); i >= 0 {
			t.Logf("VM console after the report:\n%s", res.Output[i:])
		} else {
			t.Logf("VM console:\n%s", res.Output)
		}
	}
	res.Assert(t)
	for _, name := range []string{"TestNodeDemo", "TestNodeDemoTeardownOnSignal"} {
		if v := res.Verdicts()[name]; v != "PASS" {
			t.Errorf("%s: verdict %q in the VM, want PASS", name, v)
		}
	}
	for _, o := range Outcomes {
		if !strings.Contains(res.Output, "[PASS] "+o+" (") {
			t.Errorf("the report has no [PASS] line for %q", o)
		}
	}
	if !strings.Contains(res.Output, ResultPass) {
		t.Errorf("the report has no %q line", ResultPass)
	}
}

// ExtractReport returns the demo's report from a console: the lines from
// the banner to the result line, plus the test verdict lines.
func ExtractReport(console string) string {
	var b strings.Builder
	in := false
	for _, line := range strings.Split(console, "\n") {
		if strings.Contains(line, ReportBanner) {
			in = true
		}
		if in || strings.HasPrefix(strings.TrimSpace(line), "--- ") {
			b.WriteString(line + "\n")
		}
		if strings.HasPrefix(line, ResultPass) || strings.HasPrefix(line, ResultFail) {
			in = false
		}
	}
	if b.Len() == 0 {
		return "(the demo printed no report)\n"
	}
	return b.String()
}
