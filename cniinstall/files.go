package cniinstall

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// tempPattern names temporary files. It ends in ".tmp" so a runtime
// listing the conf dir (.conf, .conflist, .json) never loads one, and it
// starts with a dot so operators see it is transient.
const tempPattern = ".aether-cni-install-*.tmp"

// isTempName reports whether a file name is one of the installer's temp files.
func isTempName(name string) bool {
	prefix, suffix, _ := strings.Cut(tempPattern, "*")
	return strings.HasPrefix(name, prefix) && strings.HasSuffix(name, suffix)
}

// WriteFileAtomic replaces path with data: a temporary file in the same
// directory (same filesystem), written, fsynced and chmodded, is renamed
// over path and the directory is fsynced. A reader sees the old bytes or
// the new ones, never a partial file.
func WriteFileAtomic(path string, data []byte, mode fs.FileMode) error {
	return writeAtomic(path, mode, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

func writeAtomic(path string, mode fs.FileMode, fill func(io.Writer) error) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, tempPattern)
	if err != nil {
		return fmt.Errorf("failed to create temporary file in %q: %w", dir, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if err = fill(f); err != nil {
		return fmt.Errorf("failed to write temporary file %q: %w", tmp, err)
	}
	if err = f.Chmod(mode); err != nil {
		return fmt.Errorf("failed to chmod temporary file %q: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("failed to sync temporary file %q: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("failed to close temporary file %q: %w", tmp, err)
	}
	if err = os.Rename(tmp, path); err != nil {
		return fmt.Errorf("failed to rename %q to %q: %w", tmp, path, err)
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("failed to open directory %q: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("failed to sync directory %q: %w", dir, err)
	}
	return nil
}

// BinaryMode is the mode of an installed plugin binary.
const BinaryMode fs.FileMode = 0o755

func fileHash(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}

// CopyBinary installs src as dst atomically with BinaryMode. It returns
// false without writing when dst already has src's content and mode, so a
// restarted installer does not rewrite a binary the runtime may be
// executing.
func CopyBinary(src, dst string) (bool, error) {
	want, err := fileHash(src)
	if err != nil {
		return false, fmt.Errorf("failed to read plugin binary %q: %w", src, err)
	}
	if st, err := os.Stat(dst); err == nil && st.Mode().Perm() == BinaryMode && st.Mode().IsRegular() {
		if have, err := fileHash(dst); err == nil && bytes.Equal(have, want) {
			return false, nil
		}
	}
	in, err := os.Open(src)
	if err != nil {
		return false, fmt.Errorf("failed to open plugin binary %q: %w", src, err)
	}
	defer in.Close()
	if err := writeAtomic(dst, BinaryMode, func(w io.Writer) error {
		_, err := io.Copy(w, in)
		return err
	}); err != nil {
		return false, fmt.Errorf("failed to install plugin binary %q: %w", dst, err)
	}
	return true, nil
}

// RemoveBinary removes dst when it still has src's content (what the
// installer copied); a binary replaced by someone else is left alone. It
// returns whether it removed the file; a missing dst is not an error.
func RemoveBinary(src, dst string) (bool, error) {
	have, err := fileHash(dst)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("failed to read installed binary %q: %w", dst, err)
	}
	want, err := fileHash(src)
	if err != nil {
		return false, fmt.Errorf("failed to read plugin binary %q: %w", src, err)
	}
	if !bytes.Equal(have, want) {
		return false, nil
	}
	if err := os.Remove(dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("failed to remove installed binary %q: %w", dst, err)
	}
	return true, nil
}

// SymlinkAtomic makes path a symlink to target: a link made under a
// temporary name in the same directory is renamed over path and the
// directory is fsynced, so a reader sees the old entry or the link.
func SymlinkAtomic(target, path string) error {
	dir := filepath.Dir(path)
	for range 10 {
		f, err := os.CreateTemp(dir, tempPattern)
		if err != nil {
			return fmt.Errorf("failed to create temporary file in %q: %w", dir, err)
		}
		tmp := f.Name()
		_ = f.Close()
		if err := os.Remove(tmp); err != nil {
			return fmt.Errorf("failed to remove temporary file %q: %w", tmp, err)
		}
		if err := os.Symlink(target, tmp); errors.Is(err, fs.ErrExist) {
			continue // the name was taken meanwhile: another one
		} else if err != nil {
			return fmt.Errorf("failed to create symlink %q: %w", tmp, err)
		}
		if err := os.Rename(tmp, path); err != nil {
			_ = os.Remove(tmp)
			return fmt.Errorf("failed to rename %q to %q: %w", tmp, path, err)
		}
		return syncDir(dir)
	}
	return fmt.Errorf("failed to create a temporary symlink in %q: every name was taken", dir)
}
