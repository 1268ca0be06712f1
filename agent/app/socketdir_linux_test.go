package app

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"aether.io/node/pkg/meshcontract"
)

// TestTightenSocketDir: an open socket directory is made 0700 in place
// only when it is a real directory of the agent's uid holding nothing but
// the agent's own files; a symlink, another owner or a foreign entry is
// left as it is, with the reason.
func TestTightenSocketDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: one case chowns the directory to another uid")
	}
	own := (&Config{XDSSocket: "/x/custom-xds.sock"}).ownNames()
	for _, tc := range []struct {
		name string
		// setup builds what is at dir under root.
		setup func(t *testing.T, dir string)
		// wantChanged and wantMode are the result and the mode afterwards
		// (0: dir is not a directory to check).
		wantChanged bool
		wantMode    os.FileMode
		wantReason  string
	}{
		{name: "missing", setup: func(*testing.T, string) {}},
		{name: "0700 left as is", setup: mkdirMode(0o700), wantMode: 0o700},
		{name: "0755 empty (kubelet's DirectoryOrCreate) tightened", setup: mkdirMode(0o755), wantChanged: true, wantMode: 0o700},
		{name: "0750 tightened", setup: mkdirMode(0o750), wantChanged: true, wantMode: 0o700},
		{
			name: "0755 with the agent's stale sockets, token and token temp file tightened",
			setup: func(t *testing.T, dir string) {
				mkdirMode(0o755)(t, dir)
				for _, n := range []string{"xds.sock", "custom-xds.sock"} {
					staleSocket(t, filepath.Join(dir, n))
				}
				for _, n := range []string{meshcontract.WorkloadAPITokenFile, tokenTempPrefix + "123"} {
					if err := os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o600); err != nil {
						t.Fatal(err)
					}
				}
			},
			wantChanged: true, wantMode: 0o700,
		},
		{
			name: "foreign entry refused",
			setup: func(t *testing.T, dir string) {
				mkdirMode(0o755)(t, dir)
				if err := os.WriteFile(filepath.Join(dir, "evil.sock"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			},
			wantMode: 0o755, wantReason: `it holds "evil.sock", which is not one of the agent's files`,
		},
		{
			name: "other owner refused",
			setup: func(t *testing.T, dir string) {
				mkdirMode(0o755)(t, dir)
				if err := os.Chown(dir, 65534, 65534); err != nil {
					t.Fatal(err)
				}
			},
			wantMode: 0o755, wantReason: "owned by uid 65534",
		},
		{
			name: "symlink to an open directory refused, target untouched",
			setup: func(t *testing.T, dir string) {
				target := dir + "-target"
				mkdirMode(0o755)(t, target)
				if err := os.Symlink(target, dir); err != nil {
					t.Fatal(err)
				}
			},
			wantMode: 0o755, wantReason: "it is a symlink",
		},
		{
			name: "regular file",
			setup: func(t *testing.T, dir string) {
				if err := os.WriteFile(dir, nil, 0o644); err != nil {
					t.Fatal(err)
				}
			},
			wantReason: "it is not a directory",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "proxy")
			tc.setup(t, dir)
			before, _ := os.Stat(dir)
			changed, _, reason, err := tightenSocketDir(dir, own)
			if err != nil {
				t.Fatal(err)
			}
			if changed != tc.wantChanged {
				t.Errorf("changed = %v, want %v", changed, tc.wantChanged)
			}
			if tc.wantReason == "" && reason != "" || !strings.Contains(reason, tc.wantReason) {
				t.Errorf("reason = %q, want %q", reason, tc.wantReason)
			}
			if tc.wantMode == 0 {
				return
			}
			after, err := os.Stat(dir) // follows a symlink: the target
			if err != nil {
				t.Fatal(err)
			}
			if after.Mode().Perm() != tc.wantMode {
				t.Errorf("mode afterwards %04o, want %04o", after.Mode().Perm(), tc.wantMode)
			}
			if !os.SameFile(before, after) {
				t.Error("the directory was replaced; it must be changed in place")
			}
		})
	}
}

// mkdirMode makes dir with exactly mode (no umask).
func mkdirMode(mode os.FileMode) func(t *testing.T, dir string) {
	return func(t *testing.T, dir string) {
		t.Helper()
		if err := os.Mkdir(dir, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			t.Fatal(err)
		}
	}
}

// staleSocket leaves a socket file at path that nobody serves.
func staleSocket(t *testing.T, path string) {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	_ = l.Close()
}
