package store

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// lockDir takes an exclusive flock on dir's agent.lock, waiting up to
// timeout for another holder (an agent being replaced) to exit. The lock
// lives as long as the returned file stays open.
func lockDir(dir string, timeout time.Duration) (*os.File, error) {
	path := filepath.Join(dir, LockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("failed to open lock %q: %w", path, err)
	}
	deadline := time.Now().Add(timeout)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			_ = f.Close()
			return nil, fmt.Errorf("failed to lock %q: %w", path, err)
		}
		if !time.Now().Before(deadline) {
			_ = f.Close()
			return nil, fmt.Errorf("failed to open store in %q: %w (%q stayed locked for %s: is another aether-agent running with this --state-dir?)", dir, ErrLocked, path, timeout)
		}
		time.Sleep(lockRetryInterval)
	}
}

// readAll reads f from its start.
func readAll(f *os.File) ([]byte, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	b := make([]byte, fi.Size())
	n, err := f.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return b[:n], nil
}

// writeFileSynced writes b to a new file path in dir (created 0700 if
// missing) and syncs the file and dir unless noSync.
func writeFileSynced(dir, path string, b []byte, noSync bool) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil && !noSync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && !noSync {
		err = syncDir(dir)
	}
	return err
}

// syncDir fsyncs a directory: a rename, create or remove in it is durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("failed to sync dir %q: %w", dir, err)
	}
	return nil
}

// zeroChunk is written over new space so later appends overwrite allocated,
// already written blocks.
var zeroChunk = make([]byte, 64<<10)

// zeroFill writes zeros over [off, off+n) of f.
func zeroFill(f *os.File, off, n int64) error {
	for n > 0 {
		c := min(n, int64(len(zeroChunk)))
		if _, err := f.WriteAt(zeroChunk[:c], off); err != nil {
			return err
		}
		off += c
		n -= c
	}
	return nil
}
