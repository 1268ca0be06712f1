// Package unixsock is the agent's one policy for the unix sockets it
// serves (CNI, admin, workload discovery, listener discovery):
//
//   - the socket's directory is created with mode 0700 when missing; an
//     existing directory open to group or others is refused, never chmod'ed
//     (a socket under /tmp must not chmod /tmp). With AllowReadableDir an
//     existing directory may be readable and searchable by group and others
//     (kubelet's plugin directory, which kubelet and hostPath
//     DirectoryOrCreate make 0750 or 0755), never writable by them;
//   - a socket file left by a dead process is replaced;
//   - a live socket (something accepts a connection on it) is refused with
//     an error naming the path, so two agents never steal each other's
//     socket; any other file type in the way is refused too;
//   - the socket is created with mode 0600 and unlinked when the listener
//     closes.
package unixsock

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"
)

// probeTimeout bounds the dial that tells a live socket from a stale one.
const probeTimeout = time.Second

// Option relaxes one rule of the policy for one socket.
type Option func(*options)

type options struct {
	// forbiddenDirPerm are the directory permission bits that refuse it.
	forbiddenDirPerm os.FileMode
	// allowedDirMode describes the directory modes accepted, for errors.
	allowedDirMode string
}

// AllowReadableDir accepts an existing socket directory that group and
// others may read and search but not write (at most 0755): nobody but its
// owner can replace the socket, and the socket itself stays 0600. A missing
// directory is still created 0700.
func AllowReadableDir() Option {
	return func(o *options) {
		o.forbiddenDirPerm = 0o022
		o.allowedDirMode = "at most 0755 (no group or other write access)"
	}
}

// Listen opens a unix socket at path following the package policy.
func Listen(path string, opts ...Option) (*net.UnixListener, error) {
	o := options{forbiddenDirPerm: 0o077, allowedDirMode: "0700 (no group or other access)"}
	for _, opt := range opts {
		opt(&o)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create socket dir %q: %w", dir, err)
	}
	if di, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("failed to stat socket dir %q: %w", dir, err)
	} else if perm := di.Mode().Perm(); perm&o.forbiddenDirPerm != 0 {
		return nil, fmt.Errorf("failed to listen on %q: socket dir %q has mode %04o; it must be %s", path, dir, perm, o.allowedDirMode)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("failed to listen on %q: a %s file is in the way; only a stale socket is replaced", path, fi.Mode().Type())
		}
		if c, err := net.DialTimeout("unix", path, probeTimeout); err == nil {
			_ = c.Close()
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
