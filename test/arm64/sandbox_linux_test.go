package arm64

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser/sockclosertest"
)

// sandboxEnv, in this test binary's environment, makes it the sandbox
// helper (sandboxMain) instead of running tests; its value is the
// emulator's path.
const sandboxEnv = "AETHER_ARM64_SANDBOX"

// binfmtDir is where a binfmt_misc instance is mounted.
const binfmtDir = "/proc/sys/fs/binfmt_misc"

// aarch64Rule registers emulator (%s) for arm64 ELF executables: qemu's
// own magic and mask (scripts/qemu-binfmt-conf.sh), the escapes parsed by
// the kernel. F opens the emulator at registration, in the sandbox's own
// mount namespace.
const aarch64Rule = `:aether-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:%s:F`

// runSandboxed runs the arm64 executable bin with args under emu, in dir,
// in a new user and mount namespace whose own binfmt_misc instance (Linux
// 6.7 or later) runs every arm64 executable under emu too: what bin starts
// (pkg/sockcloser's closers, exec'd from a memfd) runs as well, and the
// machine's binfmt settings are not touched. bin gets sockclosertest's
// EmulatorEnv. It returns bin's combined output.
func runSandboxed(t *testing.T, ctx context.Context, emu, dir, bin string, args ...string) ([]byte, error) {
	t.Helper()
	host := hostRules(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	c := exec.CommandContext(ctx, self, append([]string{bin}, args...)...)
	c.Dir = dir
	c.Env = append(os.Environ(), sandboxEnv+"="+emu)
	c.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	out, err := c.CombinedOutput()
	if after := hostRules(t); after != host {
		t.Errorf("the machine's binfmt_misc rules changed: %q, were %q", after, host)
	}
	return out, err
}

// hostRules lists this namespace's binfmt_misc rules ("" when none is
// mounted).
func hostRules(t *testing.T) string {
	t.Helper()
	ents, err := os.ReadDir(binfmtDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed to list %s: %v", binfmtDir, err)
	}
	var names string
	for _, e := range ents {
		names += e.Name() + " "
	}
	return names
}

// sandboxMain is this binary in runSandboxed's namespaces: it mounts a
// binfmt_misc instance there, registers the emulator for arm64 and execs
// the emulator on the arguments. It returns only on a failure.
func sandboxMain() int {
	emu := os.Getenv(sandboxEnv)
	if err := sandbox(emu); err != nil {
		fmt.Fprintln(os.Stderr, "test/arm64 sandbox:", err)
		return 2
	}
	return 0
}

func sandbox(emu string) error {
	if len(os.Args) < 2 {
		return errors.New("no executable to run")
	}
	// Nothing mounted here reaches the machine's namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("failed to make the sandbox's mounts private: %w", err)
	}
	if err := unix.Mount("binfmt_misc", binfmtDir, "binfmt_misc", 0, ""); err != nil {
		return fmt.Errorf("failed to mount a binfmt_misc instance in a user namespace (needs Linux 6.7 or later): %w", err)
	}
	if err := os.WriteFile(binfmtDir+"/register", fmt.Appendf(nil, aarch64Rule, emu), 0); err != nil {
		return fmt.Errorf("failed to register %s for arm64 executables: %w", emu, err)
	}
	env := []string{sockclosertest.EmulatorEnv + "=" + emu}
	for _, kv := range os.Environ() {
		if len(kv) < len(sandboxEnv)+1 || kv[:len(sandboxEnv)+1] != sandboxEnv+"=" {
			env = append(env, kv)
		}
	}
	argv := append([]string{emu}, os.Args[1:]...)
	if err := unix.Exec(emu, argv, env); err != nil {
		return fmt.Errorf("failed to exec %s: %w", emu, err)
	}
	return nil
}
