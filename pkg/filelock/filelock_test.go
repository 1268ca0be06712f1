package filelock

import (
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// TestLockExcludes holds the lock and checks a second taker waits for the
// release (ordering only; nothing is timed).
func TestLockExcludes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	unlock, err := Lock(path, 0o600)
	if err != nil {
		t.Fatal(err)
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
		got <- released.Load()
		u()
	}()
	time.Sleep(50 * time.Millisecond) // give the second taker a chance to (wrongly) get in
	released.Store(true)
	unlock()
	if !<-got {
		t.Fatal("a second Lock succeeded while the first was held")
	}
}

func TestLockReportsBadPath(t *testing.T) {
	if _, err := Lock(filepath.Join(t.TempDir(), "missing", "lock"), 0o600); err == nil {
		t.Fatal("a lock in a missing directory must fail")
	}
}
