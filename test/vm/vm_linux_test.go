package vm_test

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"aether.io/node/test/harness"
	"aether.io/node/test/vm"
)

func TestMain(m *testing.M) { harness.Main(m) }

// TestSmoke boots the lane's kernel with test/vm/smoketest inside: a real
// 802.1Q VLAN link on a veth, an arp-family nftables table that drops ARP
// requests, and the reference macvlan + host-local chain (static binaries in
// AETHER_CNI_BIN_DIR) run by libcni on a VLAN link, with TCP across the tag.
// Every smoke test must have passed, none skipped.
func TestSmoke(t *testing.T) {
	bin := vm.CompileTest(t, "./test/vm/smoketest")
	file := filepath.Join(t.TempDir(), "smoke.txt")
	if err := os.WriteFile(file, []byte("smoke-file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	res := vm.Run(t, vm.Options{
		TestBinary: bin,
		Args:       []string{"-test.v", "-test.count=1"},
		BinDir:     harness.ReferencePlugins(t),
		Files:      map[string]string{"/etc/aether-smoke.txt": file},
		Env:        map[string]string{"AETHER_SMOKE_ENV": "from-options"},
		KernelArgs: []string{"AETHER_SMOKE_KARG=from-cmdline"},
		Modules:    []string{"macvlan"},
		Timeout:    5 * time.Minute,
	})
	res.Assert(t)
	verdicts := res.Verdicts()
	for _, name := range []string{"TestVLANOnVeth", "TestARPTableDropsRequests", "TestLibcniMacvlanOnVLAN", "TestGuestPlumbing", "TestLocalhostResolves"} {
		if verdicts[name] != "PASS" {
			t.Errorf("%s: verdict %q in the VM, want PASS", name, verdicts[name])
		}
	}
	if !strings.Contains(res.Output, "\nPASS\n") {
		t.Error("the test binary did not print its final PASS")
	}
}

// TestFailureIsReported proves the lane passes a failing command's exit code
// through: the smoke test binary given an unknown flag exits 2 in the guest,
// and the host must see that code, not 0.
func TestFailureIsReported(t *testing.T) {
	bin := vm.CompileTest(t, "./test/vm/smoketest")
	res := vm.Run(t, vm.Options{
		TestBinary: bin,
		Args:       []string{"-test.no-such-flag"},
		Timeout:    5 * time.Minute,
		Quiet:      true,
	})
	if res.ExitCode != 2 {
		t.Fatalf("a test binary given an unknown flag reported TEST-EXIT %d, want 2; the console was:\n%s", res.ExitCode, res.Output)
	}
}

// EniVlanSuite is the package of the eni-vlan real-VLAN end-to-end suite.
const EniVlanSuite = "./enivlan/e2e"

// TestEniVlanVLANSuite builds eni-vlan and the reference plugins (host-local,
// static, macvlan, bridge) statically, compiles the eni-vlan end-to-end suite,
// boots one VM and runs the whole suite there with AETHER_CNI_BIN_DIR
// pointing at the binaries. It asserts exit code 0, no skipped test, and that
// tests about VLANs really ran and passed.
func TestEniVlanVLANSuite(t *testing.T) {
	res := vm.RunSuite(t, vm.Suite{
		Package:  EniVlanSuite,
		Commands: []string{"eni-vlan"},
		Options: vm.Options{
			Modules: []string{"macvlan", "bridge"},
			Memory:  1024,
			Timeout: 25 * time.Minute,
		},
	})
	var passed, vlanPassed []string
	vlanRE := regexp.MustCompile(`(?i)vlan`)
	for name, v := range res.Verdicts() {
		if v != "PASS" {
			continue
		}
		passed = append(passed, name)
		if vlanRE.MatchString(name) {
			vlanPassed = append(vlanPassed, name)
		}
	}
	sort.Strings(vlanPassed)
	if len(vlanPassed) == 0 {
		t.Errorf("no test whose name mentions VLAN passed in the VM (passed: %v)", passed)
	}
	t.Logf("VM lane: %d tests passed in the VM, VLAN tests among them: %v", len(passed), vlanPassed)
}
