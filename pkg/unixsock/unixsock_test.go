package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// listen opens path and closes the listener when the test ends.
func listen(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	l, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func TestListen(t *testing.T) {
	for _, tc := range []struct {
		name string
		// setup prepares dir and returns the socket path to listen on.
		setup func(t *testing.T, dir string) string
		// opts are passed to Listen.
		opts []Option
		// dirMode is the socket dir's mode afterwards; 0 means 0700.
		dirMode os.FileMode
		// wantErr lists substrings of the expected error; nil means success.
		wantErr []string
	}{
		{
			name:  "fresh path, missing dir created 0700",
			setup: func(_ *testing.T, dir string) string { return filepath.Join(dir, "run", "a", "s.sock") },
		},
		{
			name: "existing 0700 dir",
			setup: func(t *testing.T, dir string) string {
				mkdir(t, filepath.Join(dir, "run"), 0o700)
				return filepath.Join(dir, "run", "s.sock")
			},
		},
		{
			name: "dir open to others is refused, not chmod'ed",
			setup: func(t *testing.T, dir string) string {
				mkdir(t, filepath.Join(dir, "open"), 0o755)
				return filepath.Join(dir, "open", "s.sock")
			},
			wantErr: []string{"open", "has mode 0755", "must be 0700"},
		},
		{
			name: "dir open to group is refused",
			setup: func(t *testing.T, dir string) string {
				mkdir(t, filepath.Join(dir, "grp"), 0o710)
				return filepath.Join(dir, "grp", "s.sock")
			},
			wantErr: []string{"has mode 0710"},
		},
		{
			name: "stale socket replaced",
			setup: func(t *testing.T, dir string) string {
				p := filepath.Join(dir, "run", "s.sock")
				l := listen(t, p)
				l.SetUnlinkOnClose(false)
				_ = l.Close() // leaves a socket file nobody serves
				if _, err := os.Lstat(p); err != nil {
					t.Fatal(err)
				}
				return p
			},
		},
		{
			name: "live socket refused",
			setup: func(t *testing.T, dir string) string {
				p := filepath.Join(dir, "run", "s.sock")
				listen(t, p)
				return p
			},
			wantErr: []string{"s.sock", "another process is serving it"},
		},
		{
			name: "regular file in the way",
			setup: func(t *testing.T, dir string) string {
				p := filepath.Join(dir, "run", "s.sock")
				mkdir(t, filepath.Dir(p), 0o700)
				if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
					t.Fatal(err)
				}
				return p
			},
			wantErr: []string{"s.sock", "file is in the way"},
		},
		{
			name:  "AllowReadableDir: missing dir still created 0700",
			setup: func(_ *testing.T, dir string) string { return filepath.Join(dir, "plugins", "csi.sock") },
			opts:  []Option{AllowReadableDir()},
		},
		{
			name:    "AllowReadableDir: kubelet plugin dir 0755 accepted, not chmod'ed",
			setup:   pluginDir(0o755),
			opts:    []Option{AllowReadableDir()},
			dirMode: 0o755,
		},
		{
			name:    "AllowReadableDir: 0750 accepted",
			setup:   pluginDir(0o750),
			opts:    []Option{AllowReadableDir()},
			dirMode: 0o750,
		},
		{
			name:    "AllowReadableDir: group-writable refused",
			setup:   pluginDir(0o775),
			opts:    []Option{AllowReadableDir()},
			wantErr: []string{"has mode 0775", "must be at most 0755"},
		},
		{
			name:    "AllowReadableDir: world-writable refused",
			setup:   pluginDir(0o757),
			opts:    []Option{AllowReadableDir()},
			wantErr: []string{"has mode 0757"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := tc.setup(t, t.TempDir())
			l, err := Listen(path, tc.opts...)
			if tc.wantErr != nil {
				if err == nil {
					_ = l.Close()
					t.Fatalf("Listen(%q) succeeded, want an error", path)
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not contain %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Listen(%q): %v", path, err)
			}
			t.Cleanup(func() { _ = l.Close() })
			fi, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
				t.Errorf("socket mode %v, want a socket of mode 0600", fi.Mode())
			}
			di, err := os.Stat(filepath.Dir(path))
			if err != nil {
				t.Fatal(err)
			}
			want := tc.dirMode
			if want == 0 {
				want = 0o700
			}
			if di.Mode().Perm() != want {
				t.Errorf("dir mode %04o, want %04o", di.Mode().Perm(), want)
			}
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatalf("dial the new socket: %v", err)
			}
			_ = c.Close()
			_ = l.Close()
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Errorf("socket file left after Close: %v", err)
			}
		})
	}
}

// TestListenKeepsOpenDirMode checks a refused directory is left as it was.
func TestListenKeepsOpenDirMode(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "open")
	mkdir(t, dir, 0o755)
	if _, err := Listen(filepath.Join(dir, "s.sock")); err == nil {
		t.Fatal("listened in a 0755 dir")
	}
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o755 {
		t.Fatalf("dir mode %04o, want 0755 untouched", fi.Mode().Perm())
	}
	if _, err := os.Lstat(filepath.Join(dir, "s.sock")); !os.IsNotExist(err) {
		t.Fatalf("socket created in a refused dir: %v", err)
	}
}

func mkdir(t *testing.T, dir string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(dir, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil { // umask-proof
		t.Fatal(err)
	}
}

// pluginDir is a setup that makes the socket's directory with mode.
func pluginDir(mode os.FileMode) func(t *testing.T, dir string) string {
	return func(t *testing.T, dir string) string {
		mkdir(t, filepath.Join(dir, "plugins"), mode)
		return filepath.Join(dir, "plugins", "csi.sock")
	}
}
