// Package filelock takes exclusive flock(2) locks on files, retrying the
// interrupted system calls Go's preemption signals cause, so that processes
// on one machine (plugin invocations, parallel test binaries) serialise on a
// shared directory.
package filelock

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Lock takes an exclusive lock on path, creating the file with perm if it is
// missing, and blocks until it is held. The returned function releases it.
func Lock(path string, perm os.FileMode) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, perm)
	if err != nil {
		return nil, fmt.Errorf("failed to open lock %q: %w", path, err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("failed to lock %q: %w", path, err)
	}
	return func() { _ = unix.Flock(int(f.Fd()), unix.LOCK_UN); f.Close() }, nil
}
