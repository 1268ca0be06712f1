package arch

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// elfMagic opens every ELF file (executables, shared objects, objects).
var elfMagic = []byte{0x7f, 'E', 'L', 'F'}

// TestNoTrackedBinaries fails on any ELF file git tracks: binaries are built
// (`make build` writes bin/, which is ignored), never committed.
func TestNoTrackedBinaries(t *testing.T) {
	root := moduleRoot(t)
	cmd := exec.Command("git", "ls-files", "-z")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("failed to list tracked files with git ls-files in %q: %v", root, err)
	}
	for _, name := range bytes.Split(bytes.TrimRight(out, "\x00"), []byte{0}) {
		if len(name) == 0 {
			continue
		}
		p := filepath.Join(root, string(name))
		elf, err := isELF(p)
		if err != nil {
			t.Fatalf("failed to read tracked file %q: %v", name, err)
		}
		if elf {
			t.Errorf("%s is an ELF binary tracked by git: remove it (git rm --cached %s) and build it instead (make build writes bin/)", name, name)
		}
	}
}

// isELF reports whether the file at p starts with the ELF magic. A tracked
// file missing from the work tree (deleted, not yet committed) is not one.
func isELF(p string) (bool, error) {
	f, err := os.Open(p)
	if os.IsNotExist(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return false, err
	}
	head := make([]byte, len(elfMagic))
	if _, err := io.ReadFull(f, head); err != nil {
		return false, nil // shorter than the magic: not ELF
	}
	return bytes.Equal(head, elfMagic), nil
}
