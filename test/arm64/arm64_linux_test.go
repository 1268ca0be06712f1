package arm64

import (
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"

	"aether.io/node/test/harness"
	"aether.io/node/tools/image/oci"
)

// emulatorName is qemu-user's static aarch64 emulator (Debian's
// qemu-user-static).
const emulatorName = "qemu-aarch64-static"

// runTimeout bounds one emulated run (qemu-user starts a Go binary in
// 0.1-0.5 s here).
const runTimeout = 2 * time.Minute

func TestMain(m *testing.M) {
	if os.Getenv(sandboxEnv) != "" {
		os.Exit(sandboxMain())
	}
	harness.Main(m)
}

// emulator returns the path of qemu-aarch64-static, or "" on an arm64
// machine (the binaries run natively); without it the test fails.
func emulator(t *testing.T) string {
	t.Helper()
	if runtime.GOARCH == "arm64" {
		return ""
	}
	p, err := exec.LookPath(emulatorName)
	if err != nil {
		t.Fatalf("%s not found (%v): test/arm64 runs the arm64 binaries under it; install Debian's qemu-user-static (make deps, scripts/install-deps.sh)", emulatorName, err)
	}
	return p
}

// command returns the command running the arm64 executable bin with args,
// under emu unless emu is "".
func command(ctx context.Context, emu, bin string, args ...string) *exec.Cmd {
	if emu == "" {
		return exec.CommandContext(ctx, bin, args...)
	}
	return exec.CommandContext(ctx, emu, append([]string{bin}, args...)...)
}

// binaries builds the image's binaries (oci.Binaries) for linux/arm64 and
// returns their directory, failing unless each is an arm64 ELF executable.
func binaries(t *testing.T) string {
	t.Helper()
	start := time.Now()
	var pkgs []string
	for _, n := range oci.Binaries {
		pkgs = append(pkgs, "./cmd/"+n)
	}
	dir := harness.BuildReleaseArch(t, "arm64", pkgs...)
	for _, n := range oci.Binaries {
		f, err := elf.Open(filepath.Join(dir, n))
		if err != nil {
			t.Fatalf("failed to read %s as ELF: %v", n, err)
		}
		m := f.Machine
		_ = f.Close()
		if m != elf.EM_AARCH64 {
			t.Fatalf("%s is for %v, want EM_AARCH64", n, m)
		}
	}
	t.Logf("arm64 binaries built in %v", time.Since(start).Round(time.Millisecond))
	return dir
}

// TestHelp: every binary of the image, built for arm64, starts and prints
// its usage: --help exits 0 and names the binary.
func TestHelp(t *testing.T) {
	emu := emulator(t)
	dir := binaries(t)
	for _, n := range oci.Binaries {
		t.Run(n, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
			defer cancel()
			start := time.Now()
			out, err := command(ctx, emu, filepath.Join(dir, n), "--help").CombinedOutput()
			if err != nil {
				t.Fatalf("%s --help: %v\n%s", n, err, out)
			}
			if !bytes.Contains(out, []byte(n)) {
				t.Errorf("%s --help does not name it:\n%s", n, out)
			}
			t.Logf("%s --help in %v", n, time.Since(start).Round(time.Millisecond))
		})
	}
}

// emulatedExec is libcni's plugin executor with every plugin run under an
// emulator (none: natively): the stdin, environment and VERSION decoding
// are libcni's.
type emulatedExec struct {
	emulator string
	version.PluginDecoder
}

// ExecPlugin runs the plugin at pluginPath with stdinData on stdin and
// environ as its environment, and returns its stdout.
func (e emulatedExec) ExecPlugin(ctx context.Context, pluginPath string, stdinData []byte, environ []string) ([]byte, error) {
	var stdout, stderr bytes.Buffer
	c := command(ctx, e.emulator, pluginPath)
	c.Env = environ
	c.Stdin = bytes.NewReader(stdinData)
	c.Stdout, c.Stderr = &stdout, &stderr
	if err := c.Run(); err != nil {
		return nil, fmt.Errorf("failed to run plugin %q: %w\nstdout: %s\nstderr: %s", pluginPath, err, stdout.Bytes(), stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// FindInPath finds plugin in paths, as libcni does.
func (emulatedExec) FindInPath(plugin string, paths []string) (string, error) {
	return invoke.FindInPath(plugin, paths)
}

// TestCNIVersion: eni-vlan and aether-cni, built for arm64, answer VERSION
// through the CNI protocol as libcni asks it (CNI_COMMAND=VERSION, the
// newest cniVersion on stdin) with every version the project claims.
func TestCNIVersion(t *testing.T) {
	emu := emulator(t)
	cni := libcni.NewCNIConfig([]string{binaries(t)}, &emulatedExec{emulator: emu})
	for _, n := range []string{"eni-vlan", "aether-cni"} {
		t.Run(n, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
			defer cancel()
			info, err := cni.GetVersionInfo(ctx, n)
			if err != nil {
				t.Fatalf("%s VERSION: %v", n, err)
			}
			if got := info.SupportedVersions(); !slices.Equal(got, harness.CNIVersions) {
				t.Errorf("%s VERSION supports %v, want %v", n, got, harness.CNIVersions)
			}
		})
	}
}

// TestSocketCloser: pkg/sockcloser's tests, compiled for arm64, pass: its
// arm64 closer image (hand-assembled machine code) starts from its memfd,
// holds what it is sent, exits 0 on EOF and dies of SIGALRM after its
// life. Under the emulator, the closers the tests start are run by it too,
// through a binfmt_misc instance of the test's own user namespace
// (runSandboxed).
func TestSocketCloser(t *testing.T) {
	emu := emulator(t)
	test := harness.BuildTestArch(t, "arm64", "./pkg/sockcloser")
	ctx, cancel := context.WithTimeout(context.Background(), runTimeout)
	defer cancel()
	dir := filepath.Join(harness.ModuleRoot(), "pkg", "sockcloser")
	args := []string{"-test.v", "-test.count=1"}
	start := time.Now()
	var out []byte
	var err error
	if emu == "" {
		c := exec.CommandContext(ctx, test, args...)
		c.Dir = dir
		out, err = c.CombinedOutput()
	} else {
		out, err = runSandboxed(t, ctx, emu, dir, test, args...)
	}
	if err != nil {
		t.Fatalf("pkg/sockcloser's arm64 tests: %v\n%s", err, out)
	}
	for _, want := range []string{"--- PASS: TestExecCloser ", "--- PASS: TestExecCloserWait ", "--- PASS: TestCloserHolds ", "--- PASS: TestCloserImage "} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("pkg/sockcloser's arm64 tests did not report %q:\n%s", strings.TrimSpace(want), out)
		}
	}
	if bytes.Contains(out, []byte("--- SKIP")) {
		t.Errorf("pkg/sockcloser's arm64 tests skipped some:\n%s", out)
	}
	t.Logf("pkg/sockcloser's arm64 tests in %v", time.Since(start).Round(time.Millisecond))
}
