package filelock

import (
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// tryLock reports whether an exclusive flock on path can be taken right now,
// through its own open file description (as another process would), without
// blocking. A lock it gets is released before it returns.
func tryLock(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("failed to open lock %q: %v", path, err)
	}
	defer f.Close()
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	switch {
	case err == nil:
		if err := unix.Flock(int(f.Fd()), unix.LOCK_UN); err != nil {
			t.Fatalf("failed to unlock %q: %v", path, err)
		}
		return true
	case errors.Is(err, unix.EWOULDBLOCK):
		return false
	default:
		t.Fatalf("failed to try lock %q: %v", path, err)
		return false
	}
}

// TestLockExcludes holds the lock and checks that nobody else can take it
// (a non-blocking attempt fails), that a second Lock waits for the release,
// and that each unlock really releases (ordering only; nothing is timed).
func TestLockExcludes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	unlock, err := Lock(path, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if tryLock(t, path) {
		t.Fatal("the lock was free while Lock held it")
	}
	var released atomic.Bool
	got := make(chan bool)
	go func() {
		u, err := Lock(path, 0o600)
		if err != nil {
			t.Error(err)
			got <- false
			return
		}
		inOrder := released.Load()
		u()
		got <- inOrder
	}()
	if tryLock(t, path) {
		t.Fatal("the lock was free while Lock held it and a second Lock waited")
	}
	released.Store(true)
	unlock()
	if !<-got {
		t.Fatal("a second Lock succeeded while the first was held")
	}
	if !tryLock(t, path) {
		t.Fatal("the lock was still held after both unlocks")
	}
}

func TestLockReportsBadPath(t *testing.T) {
	if _, err := Lock(filepath.Join(t.TempDir(), "missing", "lock"), 0o600); err == nil {
		t.Fatal("a lock in a missing directory must fail")
	}
}
