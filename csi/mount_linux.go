package csi

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// kernelMounter is the Mounter of this process's mount namespace.
type kernelMounter struct{}

// NewMounter returns the Mounter of this process's mount namespace.
func NewMounter() Mounter { return kernelMounter{} }

// Bind bind-mounts dir at target, then remounts the bind nosuid, nodev and
// noexec: a socket directory holds no programs or devices.
func (kernelMounter) Bind(dir, target string) error {
	if err := unix.Mount(dir, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("failed to bind-mount %q at %q: %w", dir, target, err)
	}
	if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		_ = unix.Unmount(target, 0)
		return fmt.Errorf("failed to remount %q nosuid,nodev,noexec: %w", target, err)
	}
	return nil
}

// Unmount unmounts target; a busy mount is an error (never detached lazily).
func (kernelMounter) Unmount(target string) error {
	if err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW); err != nil {
		return fmt.Errorf("failed to unmount %q: %w", target, err)
	}
	return nil
}

// MountPoints reads /proc/self/mountinfo.
func (kernelMounter) MountPoints() ([]string, error) {
	const path = "/proc/self/mountinfo"
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("failed to open %q: %w", path, err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			return nil, fmt.Errorf("failed to parse %q: short line %q", path, sc.Text())
		}
		out = append(out, unescapeMountPath(fields[4]))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("failed to read %q: %w", path, err)
	}
	return out, nil
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space,
// \011, \012, \134).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
