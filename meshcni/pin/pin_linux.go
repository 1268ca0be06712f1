package pin

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Env variables of the detached delayed-unpin helper (the plugin binary
// re-executed); see RunHelperFromEnv.
const (
	EnvUnpinPath  = "AETHER_CNI_UNPIN_PATH"
	EnvUnpinDelay = "AETHER_CNI_UNPIN_DELAY_MS"
)

// safeName reports whether s matches ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$,
// checked by hand: a package-level regexp would be compiled at every exec
// of the plugin (~0.5 ms, 1.7k allocations) for a test this simple.
func safeName(s string) bool {
	if len(s) == 0 || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case i > 0 && (c == '_' || c == '.' || c == '-'):
		default:
			return false
		}
	}
	return true
}

// Name is the file name of a container's pin: the container ID when it is
// a safe file name, else its SHA-256.
func Name(containerID string) string {
	if safeName(containerID) {
		return containerID
	}
	s := sha256.Sum256([]byte(containerID))
	return "sha256-" + hex.EncodeToString(s[:])
}

// Path returns the pin path of containerID under dir.
func Path(dir, containerID string) string { return filepath.Join(dir, Name(containerID)) }

// Pin bind-mounts the netns at nsPath onto dir/<name> and returns that path.
// An earlier pin of the same container (a retried ADD) is replaced.
func Pin(dir, containerID, nsPath string) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("failed to create pin dir %q: %w", dir, err)
	}
	p := Path(dir, containerID)
	if err := Unpin(p); err != nil {
		return "", err
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return "", fmt.Errorf("failed to create pin %q: %w", p, err)
	}
	f.Close()
	if err := unix.Mount(nsPath, p, "none", unix.MS_BIND, ""); err != nil {
		_ = os.Remove(p)
		return "", fmt.Errorf("failed to bind mount netns %q on %q: %w", nsPath, p, err)
	}
	return p, nil
}

// Unpin unmounts and removes the pin at path. A missing pin is success.
func Unpin(path string) error {
	for {
		err := unix.Unmount(path, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(path, unix.MNT_DETACH)
		}
		if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("failed to unmount pin %q: %w", path, err)
		}
		break
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("failed to remove pin %q: %w", path, err)
	}
	return nil
}

// List returns the pin names in dir (none when dir does not exist).
func List(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("failed to list pin dir %q: %w", dir, err)
	}
	var out []string
	for _, e := range ents {
		if !e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// UnpinLater starts a detached helper (self re-executed in its own session,
// no stdio) that unpins path after delay, so the pin outlives the proxy's
// drain. delay 0 unpins now, in this process.
func UnpinLater(path string, delay time.Duration) error {
	if delay <= 0 {
		return Unpin(path)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("failed to find own executable for delayed unpin: %w", err)
	}
	cmd := exec.Command(self)
	cmd.Env = []string{EnvUnpinPath + "=" + path, EnvUnpinDelay + "=" + strconv.FormatInt(delay.Milliseconds(), 10)}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("failed to start delayed unpin of %q: %w", path, err)
	}
	return cmd.Process.Release()
}

// RunHelperFromEnv is called first thing in main: when the process is a
// delayed-unpin helper it sleeps, unpins, and returns true (main then
// exits); otherwise it returns false at once.
func RunHelperFromEnv() (bool, error) {
	path := os.Getenv(EnvUnpinPath)
	if path == "" {
		return false, nil
	}
	ms, err := strconv.Atoi(os.Getenv(EnvUnpinDelay))
	if err != nil || ms < 0 {
		return true, fmt.Errorf("invalid %s %q", EnvUnpinDelay, os.Getenv(EnvUnpinDelay))
	}
	time.Sleep(time.Duration(ms) * time.Millisecond)
	return true, Unpin(path)
}

// Pins is the package's functions as a value, for injection.
type Pins struct{}

// Pin is Pin.
func (Pins) Pin(dir, containerID, nsPath string) (string, error) {
	return Pin(dir, containerID, nsPath)
}

// Path is Path.
func (Pins) Path(dir, containerID string) string { return Path(dir, containerID) }

// Unpin is Unpin.
func (Pins) Unpin(path string) error { return Unpin(path) }

// UnpinLater is UnpinLater.
func (Pins) UnpinLater(path string, delay time.Duration) error { return UnpinLater(path, delay) }

// List is List.
func (Pins) List(dir string) ([]string, error) { return List(dir) }

// Name is Name.
func (Pins) Name(containerID string) string { return Name(containerID) }
