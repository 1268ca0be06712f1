package store

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// syncData flushes f's data and the metadata needed to read it back
// (fdatasync): with the space written ahead, only the data.
func syncData(f *os.File) error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// preallocate allocates [off, off+n) of f (failing early when the disk is
// full) and writes zeros over it, so the appends that later overwrite it
// change neither the size nor the extent map: their fdatasync flushes data
// only. The caller syncs.
func preallocate(f *os.File, off, n int64) error {
	for {
		err := unix.Fallocate(int(f.Fd()), 0, off, n)
		if err == nil || errors.Is(err, unix.EOPNOTSUPP) {
			break // a filesystem without fallocate: the zeros allocate
		}
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
	return zeroFill(f, off, n)
}
