package vm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"aether.io/node/test/harness"
)

// QemuBinary is the emulator the lane runs (Debian package qemu-system-x86).
const QemuBinary = "qemu-system-x86_64"

// GuestBinDir is where Options.BinDir's files land in the guest; the guest's
// AETHER_CNI_BIN_DIR names it, so harness.ReferencePlugins and
// harness.BuildOwn find the binaries there without a Go toolchain.
const GuestBinDir = "/bin/cni"

// GuestTestBinary is where Options.TestBinary lands in the guest.
const GuestTestBinary = "/bin/test.bin"

// InVMEnv is set to 1 in the guest command's environment.
const InVMEnv = "AETHER_VM"

// DebugDirEnv names a directory that receives, for every run, the console
// (<test name>.console), the initramfs (<test name>.initrd.gz) and a shell
// script booting it by hand (<test name>.qemu.sh).
const DebugDirEnv = "AETHER_VM_DEBUG_DIR"

// Options describe one VM run.
type Options struct {
	// TestBinary is a static binary on the host (see CompileTest) run as the
	// guest's only command.
	TestBinary string
	// Args are the command's arguments (for example "-test.v").
	Args []string
	// Files maps guest paths to host files copied into the initramfs.
	Files map[string]string
	// BinDir, when set, is a host directory whose files (symlinks followed,
	// dot files left out) are copied to GuestBinDir; AETHER_CNI_BIN_DIR is
	// then set in the guest.
	BinDir string
	// Env are extra KEY=VALUE pairs for the command.
	Env map[string]string
	// Modules are loaded in addition to DefaultModules (dependencies
	// resolved from the kernel package).
	Modules []string
	// KernelArgs are appended to the kernel command line; unrecognised
	// KEY=VALUE words reach /init's (and the command's) environment.
	KernelArgs []string
	// Memory is the guest memory in MiB (512 when zero).
	Memory int
	// CPUs is the number of virtual CPUs (1 when zero). Under TCG each is a
	// host thread; the machine has 2 cores shared with other work.
	CPUs int
	// Timeout bounds the whole run, boot included (10 minutes when zero).
	Timeout time.Duration
	// Quiet stops the console from being streamed into the test log; it is
	// still returned in Result.Output and shown when the run fails.
	Quiet bool
}

// Result is what a finished run reported.
type Result struct {
	// Output is the whole serial console (kernel messages, /init, command).
	Output string
	// ExitCode is the command's exit code from the TEST-EXIT marker.
	ExitCode int
	// Boot is the host time from starting qemu to /init's first line.
	Boot time.Duration
	// Total is the host time from starting qemu to the TEST-EXIT marker.
	Total time.Duration
}

var markerRE = regexp.MustCompile(`(?m)^TEST-EXIT (-?\d+)\r?$`)

var (
	initMu   sync.Mutex
	initPath string
)

// buildInit compiles test/vm/init statically, once per test process.
func buildInit(tb testing.TB) string {
	tb.Helper()
	initMu.Lock()
	defer initMu.Unlock()
	if initPath != "" {
		if _, err := os.Stat(initPath); err == nil {
			return initPath
		}
	}
	dir, err := os.MkdirTemp("", "aether-vm-init-")
	if err != nil {
		tb.Fatal(err)
	}
	out := filepath.Join(dir, "init")
	goBuildStatic(tb, "build", "-o", out, "./test/vm/init")
	initPath = out
	return out
}

func goBuildStatic(tb testing.TB, args ...string) {
	tb.Helper()
	full := append([]string{args[0], "-trimpath", "-ldflags=-s -w"}, args[1:]...)
	cmd := exec.Command("go", full...)
	cmd.Dir = harness.ModuleRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("failed to run go %s: %v\n%s", strings.Join(full, " "), err, out)
	}
}

// GuestBuildTag is the build tag CompileTest sets. Test files that only
// make sense in the VM (they need 802.1Q, which the CI host kernel lacks)
// carry `//go:build aethervm`, so `go test ./...` on the host does not run
// them, and the VM lane does.
const GuestBuildTag = "aethervm"

// CompileTest builds the tests of a package of this module (a path relative
// to the module root, such as "./test/vm/smoketest") into one static binary
// (CGO_ENABLED=0, GOOS=linux, GOARCH=amd64, -tags aethervm) in a temporary
// directory removed at the end of the test, and returns its path.
func CompileTest(tb testing.TB, pkg string) string {
	tb.Helper()
	out := filepath.Join(tb.TempDir(), path.Base(pkg)+".test")
	goBuildStatic(tb, "test", "-c", "-tags", GuestBuildTag, "-o", out, pkg)
	if _, err := os.Stat(out); err != nil {
		tb.Fatalf("go test -c %s wrote no binary (does the package have tests for linux/amd64?): %v", pkg, err)
	}
	return out
}

// BuildStatic builds packages (module paths or ./relative to the module
// root) statically into dir, as `go build -o dir/`.
func BuildStatic(tb testing.TB, dir string, pkgs ...string) {
	tb.Helper()
	goBuildStatic(tb, append([]string{"build", "-o", dir + "/"}, pkgs...)...)
}

type guestConfig struct {
	Modules []string `json:"modules"`
	Env     []string `json:"env"`
	Argv    []string `json:"argv"`
	Dir     string   `json:"dir"`
}

// buildInitramfs writes the gzip cpio for o into dir and returns its path.
func buildInitramfs(tb testing.TB, k *Kernel, o Options, dir string) string {
	tb.Helper()
	a := NewArchive()
	must := func(err error) {
		tb.Helper()
		if err != nil {
			tb.Fatalf("VM lane: %v", err)
		}
	}
	for _, d := range []string{"/proc", "/sys", "/dev", "/tmp", "/run", "/root", "/etc", "/bin", "/sbin", "/var/lib", "/lib/modules"} {
		must(a.Dir(d, 0o755))
	}
	must(a.Symlink("/var/run", "../run"))
	must(a.Symlink("/var/tmp", "../tmp"))
	must(a.CharDev("/dev/console", 0o600, 5, 1))
	must(a.CharDev("/dev/null", 0o666, 1, 3))
	must(a.File("/init", buildInit(tb)))
	// Enough of /etc for Go's pure resolver and os/user.
	must(a.Bytes("/etc/hosts", 0o644, []byte("127.0.0.1 localhost\n::1 localhost\n")))
	must(a.Bytes("/etc/nsswitch.conf", 0o644, []byte("hosts: files dns\n")))
	must(a.Bytes("/etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n")))
	must(a.Bytes("/etc/group", 0o644, []byte("root:x:0:\n")))

	mods, err := k.Modules(append(append([]string{}, DefaultModules...), o.Modules...)...)
	must(err)
	cfg := guestConfig{Dir: "/"}
	for _, m := range mods {
		g := "/lib/modules/" + m.Name + ".ko"
		must(a.File(g, m.Path))
		cfg.Modules = append(cfg.Modules, g)
	}
	if o.TestBinary == "" {
		tb.Fatal("VM lane: Options.TestBinary is empty")
	}
	must(a.File(GuestTestBinary, o.TestBinary))
	cfg.Argv = append([]string{GuestTestBinary}, o.Args...)
	if o.BinDir != "" {
		ents, err := os.ReadDir(o.BinDir)
		must(err)
		for _, e := range ents {
			if !e.IsDir() && !strings.HasPrefix(e.Name(), ".") { // symlinks are followed
				must(a.File(GuestBinDir+"/"+e.Name(), filepath.Join(o.BinDir, e.Name())))
			}
		}
		cfg.Env = append(cfg.Env, harness.BinDirEnv+"="+GuestBinDir)
	}
	cfg.Env = append(cfg.Env, InVMEnv+"=1")
	guestPaths := make([]string, 0, len(o.Files))
	for g := range o.Files {
		guestPaths = append(guestPaths, g)
	}
	sort.Strings(guestPaths)
	for _, g := range guestPaths {
		must(a.File(g, o.Files[g]))
	}
	keys := make([]string, 0, len(o.Env))
	for k := range o.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		cfg.Env = append(cfg.Env, k+"="+o.Env[k])
	}
	raw, err := json.MarshalIndent(cfg, "", "  ")
	must(err)
	must(a.Bytes("/etc/aether-vm.json", 0o644, raw))

	p := filepath.Join(dir, "initrd.gz")
	f, err := os.Create(p)
	must(err)
	bw := bufio.NewWriterSize(f, 1<<20)
	must(a.WriteGzip(bw))
	must(bw.Flush())
	must(f.Close())
	return p
}

// QemuArgs returns the qemu command line that boots kernel with initrd:
// TCG on the microvm machine, the serial console on stdout, and no reboot,
// so the guest's restart ends qemu. no_timer_check: under TCG on a loaded
// host the kernel's IO-APIC timer check can miss its ticks and panic ("IO-APIC
// + timer doesn't work", seen in make test at load 10); the check proves
// nothing about the code under test.
func QemuArgs(kernel, initrd string, memory, cpus int, kernelArgs []string) []string {
	cmdline := append([]string{"console=ttyS0", "panic=-1", "reboot=t", "quiet", "loglevel=5", "acpi=off", "pci=off", "no_timer_check"}, kernelArgs...)
	return []string{
		"-accel", "tcg",
		"-M", "microvm,x-option-roms=off,rtc=on,acpi=off",
		"-cpu", "qemu64",
		"-m", strconv.Itoa(memory),
		"-smp", strconv.Itoa(cpus),
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-serial", "stdio",
		"-no-reboot",
		"-kernel", kernel,
		"-initrd", initrd,
		"-append", strings.Join(cmdline, " "),
	}
}

// Run boots a VM with the options' initramfs, streams its console into the
// test log and returns the command's exit code. It fails the test when qemu
// or the kernel cannot be had, when the run times out, or when the console
// holds no TEST-EXIT marker; a non-zero exit code is returned for the caller
// to judge.
func Run(tb testing.TB, o Options) Result {
	tb.Helper()
	qemu, err := exec.LookPath(QemuBinary)
	if err != nil {
		tb.Fatalf("VM lane: %s not found: install it with `apt-get install -y qemu-system-x86` (the lane never skips)", QemuBinary)
	}
	if o.Memory == 0 {
		o.Memory = 512
	}
	if o.CPUs == 0 {
		o.CPUs = 1
	}
	if o.Timeout == 0 {
		o.Timeout = 10 * time.Minute
	}
	k := FetchKernel(tb)
	dir := tb.TempDir()
	initrd := buildInitramfs(tb, k, o, dir)
	if fi, err := os.Stat(initrd); err == nil {
		tb.Logf("VM lane: kernel %s %s, initramfs %.1f MB", k.Package, k.Version, float64(fi.Size())/1e6)
	}

	qargs := QemuArgs(k.Vmlinux, initrd, o.Memory, o.CPUs, o.KernelArgs)
	keepForDebug(tb, qemu, qargs, initrd)
	ctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, qemu, qargs...)
	cmd.WaitDelay = 5 * time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		tb.Fatalf("VM lane: failed to start %s: %v", qemu, err)
	}
	var console bytes.Buffer
	var res Result
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		console.WriteString(line + "\n")
		if res.Boot == 0 && strings.HasPrefix(line, "aether-init: started") {
			res.Boot = time.Since(start)
		}
		if res.Total == 0 && markerRE.MatchString(line) {
			res.Total = time.Since(start)
		}
		if !o.Quiet {
			tb.Logf("vm| %s", line)
		}
	}
	_, _ = io.Copy(io.Discard, stdout)
	waitErr := cmd.Wait()
	res.Output = console.String()
	saveConsole(tb, res.Output)

	fail := func(format string, args ...any) {
		tb.Helper()
		tail := res.Output
		if o.Quiet || len(tail) > 8000 {
			if len(tail) > 8000 {
				tail = "…" + tail[len(tail)-8000:]
			}
			tb.Logf("VM console (tail):\n%s", tail)
		}
		tb.Fatalf("VM lane: "+format, args...)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		fail("the VM did not finish within %v (killed); qemu stderr: %s", o.Timeout, stderr.String())
	}
	m := markerRE.FindAllStringSubmatch(res.Output, -1)
	if len(m) == 0 {
		fail("no TEST-EXIT marker on the console (the guest crashed or /init did not run)%s; qemu: %v; stderr: %s", crashHints(res.Output), waitErr, stderr.String())
	}
	res.ExitCode, _ = strconv.Atoi(m[len(m)-1][1])
	if waitErr != nil {
		tb.Logf("VM lane: qemu ended with %v after the marker; stderr: %s", waitErr, stderr.String())
	}
	tb.Logf("VM lane: boot to /init %v, boot to TEST-EXIT %v, exit code %d", res.Boot.Round(time.Millisecond), res.Total.Round(time.Millisecond), res.ExitCode)
	return res
}

var (
	runLineRE   = regexp.MustCompile(`(?m)^=== (?:RUN|CONT)\s+(\S+)`)
	kernelBadRE = regexp.MustCompile(`(?m)^.*(?:Kernel panic|BUG:|Oops|general protection fault|Out of memory|invoked oom-killer|watchdog: ).*$`)
)

// crashHints names the last test that was running and the first kernel
// lines that explain a crash, for a run without its marker.
func crashHints(out string) string {
	var h []string
	if m := runLineRE.FindAllStringSubmatch(out, -1); len(m) > 0 {
		h = append(h, "last test started: "+m[len(m)-1][1])
	}
	if m := kernelBadRE.FindAllString(out, 3); len(m) > 0 {
		h = append(h, "kernel: "+strings.Join(m, " | "))
	}
	if !strings.Contains(out, "aether-init: started") {
		h = append(h, "/init never started")
	}
	if len(h) == 0 {
		return ""
	}
	return " (" + strings.Join(h, "; ") + ")"
}

func debugPath(tb testing.TB, suffix string) string {
	d := os.Getenv(DebugDirEnv)
	if d == "" {
		return ""
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		tb.Logf("VM lane: failed to create %s: %v", d, err)
		return ""
	}
	return filepath.Join(d, strings.NewReplacer("/", "_", " ", "_").Replace(tb.Name())+suffix)
}

func saveConsole(tb testing.TB, out string) {
	if p := debugPath(tb, ".console"); p != "" {
		if err := os.WriteFile(p, []byte(out), 0o644); err != nil {
			tb.Logf("VM lane: failed to save the console: %v", err)
		}
	}
}

// keepForDebug copies the initramfs next to a script that boots it as Run
// does.
func keepForDebug(tb testing.TB, qemu string, args []string, initrd string) {
	p := debugPath(tb, ".initrd.gz")
	if p == "" {
		return
	}
	data, err := os.ReadFile(initrd)
	if err == nil {
		err = os.WriteFile(p, data, 0o644)
	}
	if err != nil {
		tb.Logf("VM lane: failed to keep the initramfs: %v", err)
		return
	}
	quoted := []string{qemu}
	for _, a := range args {
		if a == initrd {
			a = p
		}
		quoted = append(quoted, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
	}
	script := "#!/bin/sh\n# Boots the VM of " + tb.Name() + " as test/vm.Run did; Ctrl-C quits.\nexec " + strings.Join(quoted, " ") + "\n"
	if err := os.WriteFile(strings.TrimSuffix(p, ".initrd.gz")+".qemu.sh", []byte(script), 0o755); err != nil {
		tb.Logf("VM lane: failed to write the boot script: %v", err)
	}
}

// Assert fails the test unless the run exited 0, naming the code.
func (r Result) Assert(tb testing.TB) {
	tb.Helper()
	if r.ExitCode != 0 {
		tb.Fatalf("VM lane: the command in the VM exited %d (want 0); see the console above", r.ExitCode)
	}
}

// Verdicts returns the final "--- PASS/FAIL/SKIP: Name" verdict of each test
// (and subtest) in a `go test -v` console, keyed by test name.
func (r Result) Verdicts() map[string]string {
	v := map[string]string{}
	for _, m := range verdictRE.FindAllStringSubmatch(r.Output, -1) {
		v[m[2]] = m[1]
	}
	return v
}

var verdictRE = regexp.MustCompile(`(?m)^\s*--- (PASS|FAIL|SKIP): (\S+) \(`)
