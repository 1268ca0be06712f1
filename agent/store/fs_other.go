//go:build !linux

package store

import "os"

// syncData flushes f (fsync: fdatasync is Linux's).
func syncData(f *os.File) error { return f.Sync() }

// preallocate writes zeros over [off, off+n) of f. The caller syncs.
func preallocate(f *os.File, off, n int64) error { return zeroFill(f, off, n) }
