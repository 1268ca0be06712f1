package csi

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
)

// privateMountNSEnv marks the re-executed test binary.
const privateMountNSEnv = "AETHER_CSI_TEST_PRIVATE_MOUNT_NS"

// TestMain runs the package's tests, as root, in a private mount namespace
// (the test binary re-executes itself with CLONE_NEWNS; Go makes the new
// namespace's mounts private), so no bind mount a test makes can reach the
// host's mount table even if a cleanup fails. It also fails the run if a
// test leaves a mount point behind.
func TestMain(m *testing.M) {
	if os.Geteuid() == 0 && os.Getenv(privateMountNSEnv) == "" {
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), privateMountNSEnv+"=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
		if err := cmd.Run(); err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				os.Exit(ee.ExitCode())
			}
			fmt.Fprintln(os.Stderr, "failed to re-run the tests in a private mount namespace:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	before, err := NewMounter().MountPoints()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	after, err := NewMounter().MountPoints()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for _, mp := range after {
		if !slices.Contains(before, mp) {
			fmt.Fprintln(os.Stderr, "LEAK: tests left a mount point:", mp)
			code = 1
		}
	}
	os.Exit(code)
}
