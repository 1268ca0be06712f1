package vm

import (
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
)

// Mode bits of cpio entries (the st_mode file types).
const (
	modeDir     = 0o040000
	modeFile    = 0o100000
	modeSymlink = 0o120000
	modeCharDev = 0o020000
)

type entry struct {
	mode         uint32
	data         []byte // file contents or link target
	hostPath     string // file contents read from here when set
	major, minor uint32 // device numbers of a device node
}

// Archive is an initramfs under construction: a set of directories, files,
// symlinks and device nodes written as a gzip-compressed newc cpio archive,
// the format the Linux kernel unpacks into its root file system.
type Archive struct {
	entries map[string]*entry
}

// NewArchive returns an empty archive.
func NewArchive() *Archive {
	return &Archive{entries: map[string]*entry{}}
}

func clean(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("initramfs path %q is not absolute", p)
	}
	c := strings.TrimPrefix(path.Clean(p), "/")
	if c == "" {
		return "", fmt.Errorf("initramfs path %q names the root", p)
	}
	return c, nil
}

func (a *Archive) add(p string, e *entry) error {
	c, err := clean(p)
	if err != nil {
		return err
	}
	if old, ok := a.entries[c]; ok && (old.mode&0o170000 != modeDir || e.mode&0o170000 != modeDir) {
		return fmt.Errorf("initramfs path %q added twice", p)
	}
	for d := path.Dir(c); d != "."; d = path.Dir(d) {
		if old, ok := a.entries[d]; ok {
			if old.mode&0o170000 != modeDir {
				return fmt.Errorf("initramfs path %q: parent %q is not a directory", p, d)
			}
			continue
		}
		a.entries[d] = &entry{mode: modeDir | 0o755}
	}
	a.entries[c] = e
	return nil
}

// Dir adds a directory (and its parents).
func (a *Archive) Dir(p string, perm os.FileMode) error {
	return a.add(p, &entry{mode: modeDir | uint32(perm.Perm())})
}

// Bytes adds a file with the given contents.
func (a *Archive) Bytes(p string, perm os.FileMode, data []byte) error {
	return a.add(p, &entry{mode: modeFile | uint32(perm.Perm()), data: data})
}

// File adds a file copied from hostPath when the archive is written; the
// permission bits are the host file's.
func (a *Archive) File(p, hostPath string) error {
	fi, err := os.Stat(hostPath)
	if err != nil {
		return fmt.Errorf("failed to add %q to the initramfs: %w", p, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("failed to add %q to the initramfs: %q is not a regular file", p, hostPath)
	}
	return a.add(p, &entry{mode: modeFile | uint32(fi.Mode().Perm()), hostPath: hostPath})
}

// Symlink adds a symbolic link to target.
func (a *Archive) Symlink(p, target string) error {
	return a.add(p, &entry{mode: modeSymlink | 0o777, data: []byte(target)})
}

// CharDev adds a character device node.
func (a *Archive) CharDev(p string, perm os.FileMode, major, minor uint32) error {
	return a.add(p, &entry{mode: modeCharDev | uint32(perm.Perm()), major: major, minor: minor})
}

// WriteGzip writes the archive as newc cpio, compressed with gzip at its
// fastest level (the kernel decompresses it under TCG, where time counts).
func (a *Archive) WriteGzip(w io.Writer) error {
	zw, err := gzip.NewWriterLevel(w, gzip.BestSpeed)
	if err != nil {
		return err
	}
	if err := a.WriteCpio(zw); err != nil {
		return err
	}
	return zw.Close()
}

// WriteCpio writes the archive as uncompressed newc cpio, parents before
// children, ending with the TRAILER!!! entry.
func (a *Archive) WriteCpio(w io.Writer) error {
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	// Sorting by path puts every directory before its contents.
	sort.Strings(names)
	cw := &cpioWriter{w: w}
	for i, n := range names {
		e := a.entries[n]
		if err := cw.write(uint32(i+1), n, e); err != nil {
			return err
		}
	}
	return cw.trailer(uint32(len(names) + 1))
}

type cpioWriter struct {
	w   io.Writer
	off int64
}

func (c *cpioWriter) put(b []byte) error {
	n, err := c.w.Write(b)
	c.off += int64(n)
	return err
}

func (c *cpioWriter) pad() error {
	if r := c.off % 4; r != 0 {
		return c.put(make([]byte, 4-r))
	}
	return nil
}

func (c *cpioWriter) header(ino uint32, name string, mode uint32, size int64, major, minor uint32) error {
	nlink := 1
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	if size > 0xffffffff {
		return fmt.Errorf("initramfs file %q is too large for newc cpio (%d bytes)", name, size)
	}
	h := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		ino, mode, 0, 0, nlink, 0, size, 0, 0, major, minor, len(name)+1, 0)
	if err := c.put([]byte(h)); err != nil {
		return err
	}
	if err := c.put(append([]byte(name), 0)); err != nil {
		return err
	}
	return c.pad()
}

func (c *cpioWriter) write(ino uint32, name string, e *entry) error {
	if e.hostPath == "" {
		if err := c.header(ino, name, e.mode, int64(len(e.data)), e.major, e.minor); err != nil {
			return err
		}
		if err := c.put(e.data); err != nil {
			return err
		}
		return c.pad()
	}
	f, err := os.Open(e.hostPath)
	if err != nil {
		return fmt.Errorf("failed to read %q for the initramfs: %w", e.hostPath, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if err := c.header(ino, name, e.mode, fi.Size(), 0, 0); err != nil {
		return err
	}
	n, err := io.Copy(writerFunc(c.put), f)
	if err != nil {
		return fmt.Errorf("failed to copy %q into the initramfs: %w", e.hostPath, err)
	}
	if n != fi.Size() {
		return fmt.Errorf("%q changed size while being copied into the initramfs", e.hostPath)
	}
	return c.pad()
}

func (c *cpioWriter) trailer(ino uint32) error {
	return c.header(ino, "TRAILER!!!", 0, 0, 0, 0)
}

type writerFunc func([]byte) error

func (f writerFunc) Write(b []byte) (int, error) {
	if err := f(b); err != nil {
		return 0, err
	}
	return len(b), nil
}
