package cniserver

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Listen opens a unix socket at path with mode 0600 in a directory of mode
// 0700 (created if missing; an existing directory open to group or others
// is refused rather than changed, so a socket path under /tmp never
// chmods /tmp). A socket file left by a dead agent is replaced;
// a live one (it accepts a connection) or a non-socket file is an error, so
// two agents never steal each other's socket.
func Listen(path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create socket dir %q: %w", dir, err)
	}
	if di, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("failed to stat socket dir %q: %w", dir, err)
	} else if perm := di.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("failed to listen on %q: socket dir %q has mode %04o; it must be 0700 (no group or other access)", path, dir, perm)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("failed to listen on %q: a %s file is in the way; only a stale socket is replaced", path, fi.Mode().Type())
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("failed to listen on %q: another process is serving it", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("failed to remove stale socket %q: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("failed to stat socket %q: %w", path, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("failed to listen on %q: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("failed to restrict socket %q to 0600: %w", path, err)
	}
	l.SetUnlinkOnClose(true)
	return l, nil
}
