package demo

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"aether.io/node/test/harness"
)

var daemonPIDsRE = regexp.MustCompile(`aether-agent pid (\d+), aether-proxy pid (\d+)`)

// TestNodeDemoTeardownOnSignal runs TestNodeDemo as a child process (this
// test binary again), sends it SIGTERM — what scripts/demo.sh sends on
// Ctrl-C — once the pods are up, and checks that the demo stopped, said
// so, and tore everything down: its daemons are gone, no namespace, netns
// mount or pin it made is left, and its own leak check found nothing. It
// runs where TestNodeDemo runs (in the VM lane, or with AETHER_DEMO=1).
func TestNodeDemoTeardownOnSignal(t *testing.T) {
	if os.Getenv(DemoEnv) != "1" && os.Getenv(InVMEnv) != "1" {
		t.Skipf("runs where TestNodeDemo runs (%s=1 or inside the VM lane); TestNodeDemoInVM runs it in CI", DemoEnv)
	}
	harness.RequireRoot(t)
	if err := requireVLAN(); err != nil {
		t.Fatalf("this kernel cannot create 802.1Q VLAN links (%v): run it in the VM lane (TestNodeDemoInVM)", err)
	}
	before := netnsEntries(t)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestNodeDemo$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), DemoEnv+"=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var (
		out      strings.Builder
		pids     []int
		signaled bool
	)
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Text()
		out.WriteString(line + "\n")
		if m := daemonPIDsRE.FindStringSubmatch(line); m != nil {
			for _, s := range m[1:] {
				n, _ := strconv.Atoi(s)
				pids = append(pids, n)
			}
		}
		if !signaled && strings.HasPrefix(line, "[PASS] pods up") {
			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatalf("failed to signal the demo: %v", err)
			}
			signaled = true
		}
	}
	waitErr := cmd.Wait()
	output := out.String()
	if !signaled {
		t.Fatalf("the demo never printed \"[PASS] pods up\", so it was not interrupted (exit: %v); its output:\n%s", waitErr, output)
	}
	if waitErr == nil {
		t.Errorf("the interrupted demo exited 0; want a failure (it did not finish its outcomes)")
	}
	if !strings.Contains(output, "interrupted: tearing everything down") {
		t.Errorf("the demo did not say it was interrupted")
	}
	if strings.Contains(output, "LEAK:") {
		t.Errorf("the interrupted demo's leak check found leftovers")
	}
	if !strings.Contains(output, ResultFail) {
		t.Errorf("the interrupted demo printed no %q line", ResultFail)
	}
	if len(pids) != 2 {
		t.Errorf("could not read the agent and proxy pids from the demo's report")
	}
	for _, pid := range pids {
		if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err == nil {
			t.Errorf("daemon pid %d is still running after the interrupted demo", pid)
		}
	}
	if left := added(before, netnsEntries(t)); len(left) > 0 {
		t.Errorf("namespaces left in %s: %v", harness.NetNSDir, left)
	}
	if m := mounts(harness.NetNSDir); len(m) > 0 {
		t.Errorf("netns mounts left: %v", m)
	}
	for _, m := range mounts(os.TempDir()) {
		if strings.Contains(m, "aether-demo-") {
			t.Errorf("pin mount left: %s", m)
		}
	}
	if t.Failed() {
		t.Logf("the interrupted demo's output:\n%s", output)
		return
	}
	var last string
	for _, l := range strings.Split(output, "\n") {
		if strings.HasPrefix(l, ResultFail) {
			last = l
		}
	}
	t.Logf("SIGTERM after \"pods up\": the demo exited with %v, said it was interrupted, stopped daemons %v and left nothing (%s)", waitErr, pids, last)
}

func netnsEntries(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(harness.NetNSDir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, filepath.Join(harness.NetNSDir, e.Name()))
	}
	return out
}

func added(before, after []string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) {
			out = append(out, a)
		}
	}
	return out
}
