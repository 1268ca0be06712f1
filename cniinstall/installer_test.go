package cniinstall

import (
	"bytes"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// env is one node: a conf dir, a bin dir, the image's source dir and a
// state dir outside the conf dir.
type env struct {
	conf, bin, src, state string
}

func newEnv(t testing.TB) env {
	t.Helper()
	root := t.TempDir()
	e := env{
		conf:  filepath.Join(root, "etc/cni/net.d"),
		bin:   filepath.Join(root, "opt/cni/bin"),
		src:   filepath.Join(root, "image/bin"),
		state: filepath.Join(root, "var/lib/aether/cni-install/state.json"),
	}
	for _, d := range []string{e.conf, e.bin, e.src} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range []string{"aether-cni", "eni-vlan"} {
		if err := os.WriteFile(filepath.Join(e.src, b), []byte("#!/bin/sh\n# "+b+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e env) installer(t testing.TB) *Installer {
	t.Helper()
	i, err := New(Config{
		BinDir: e.bin, ConfDir: e.conf, SourceDir: e.src, StateFile: e.state,
		Binaries: []string{"aether-cni", "eni-vlan"},
		Entry:    []byte(testEntry),
	}, slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	return i
}

func (e env) write(t testing.TB, name string, data []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(e.conf, name), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func (e env) read(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.conf, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// files lists the conf dir (names and modes), to prove nothing else was
// left behind (no temp files, no converted conflist).
func (e env) files(t testing.TB) []string {
	t.Helper()
	ents, err := os.ReadDir(e.conf)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ents {
		fi, err := d.Info()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d.Name()+" "+fi.Mode().Perm().String())
	}
	sort.Strings(out)
	return out
}

func reconcile(t testing.TB, i *Installer, want Outcome) {
	t.Helper()
	got, err := i.Reconcile()
	if err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	if got != want {
		t.Fatalf("Reconcile = %v, want %v", got, want)
	}
}

func mustNotExist(t testing.TB, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("%s exists (err=%v); want it gone", path, err)
	}
}

// TestRoundTrip: every real-looking primary is chained, chaining again is a
// no-op, and uninstall gives back the original bytes, name and mode and
// nothing else, also from a restarted installer.
func TestRoundTrip(t *testing.T) {
	for name, orig := range primaries(t) {
		for _, restart := range []bool{false, true} {
			sub := name
			if restart {
				sub += "/after_restart"
			}
			t.Run(sub, func(t *testing.T) {
				e := newEnv(t)
				e.write(t, name, orig)
				// A file the runtime sorts after the primary is never touched.
				other := list("zz")
				e.write(t, "99-other.conflist", []byte(other))
				if err := os.Chmod(filepath.Join(e.conf, name), 0o600); err != nil {
					t.Fatal(err)
				}
				before := e.files(t)
				i := e.installer(t)
				foreign, err := HasPlugin(orig)
				if err != nil && isList(name) {
					t.Fatal(err)
				}
				if foreign && isList(name) {
					reconcile(t, i, Foreign)
					reconcile(t, i, Foreign)
					if got := e.read(t, name); !bytes.Equal(got, orig) {
						t.Fatalf("a primary that already chains aether-cni was changed:\n%s", got)
					}
					mustNotExist(t, e.state)
					if err := i.Uninstall(); err != nil {
						t.Fatal(err)
					}
					if got := e.read(t, name); !bytes.Equal(got, orig) {
						t.Fatalf("uninstall changed an aether-cni entry it did not add:\n%s", got)
					}
					return
				}
				reconcile(t, i, Chained)
				written := ListPath(name)
				chained := e.read(t, written)
				if _, err := LoadNetwork(filepath.Join(e.conf, written)); err != nil {
					t.Fatalf("chained %s does not load: %v", written, err)
				}
				if types := pluginTypes(t, chained); types[len(types)-1] != PluginType {
					t.Fatalf("plugin types %v: want %s last", types, PluginType)
				}
				if fi, err := os.Stat(filepath.Join(e.conf, written)); err != nil || fi.Mode().Perm() != 0o600 {
					t.Fatalf("chained file mode %v (err %v), want the primary's 0600", fi.Mode(), err)
				}
				if written != name {
					mustNotExist(t, filepath.Join(e.conf, name))
				}
				if primary, _, _ := FindPrimary(e.conf); primary == nil || primary.Path != filepath.Join(e.conf, written) {
					t.Fatalf("runtime's primary is %v, want the chained %q", primary, written)
				}
				if restart {
					i = e.installer(t)
				}
				reconcile(t, i, Unchanged)
				if got := e.read(t, written); !bytes.Equal(got, chained) {
					t.Fatalf("second install rewrote the primary:\n%s", got)
				}
				if err := i.Uninstall(); err != nil {
					t.Fatal(err)
				}
				if got := e.read(t, name); !bytes.Equal(got, orig) {
					t.Fatalf("uninstall did not restore %s byte for byte:\nwant %q\ngot  %q", name, orig, got)
				}
				if got := string(e.read(t, "99-other.conflist")); got != other {
					t.Fatalf("a file after the primary was changed: %s", got)
				}
				if after := e.files(t); strings.Join(after, "\n") != strings.Join(before, "\n") {
					t.Fatalf("conf dir after uninstall:\n%s\nwant:\n%s", strings.Join(after, "\n"), strings.Join(before, "\n"))
				}
				mustNotExist(t, e.state)
			})
		}
	}
}

// TestRepair: what the installer does when another writer changes the conf
// dir between install and uninstall.
func TestRepair(t *testing.T) {
	bridge := primaries(t)["10-bridge.conflist"]
	bridgeV2 := bytes.Replace(bridge, []byte("10.244.1.0/24"), []byte("10.244.9.0/24"), 1)
	single := primaries(t)["10-bridge.conf"]
	singleV2 := bytes.Replace(single, []byte("10.22.0.0/16"), []byte("10.23.0.0/16"), 1)
	for _, tc := range []struct {
		name    string
		primary string
		orig    []byte
		// rewrite is another writer's change after the chain is in place.
		rewrite func(t *testing.T, e env)
		outcome Outcome
		// after uninstall: file name → content; absent names must not exist.
		want   map[string][]byte
		absent []string
	}{
		{
			name: "rewritten without aether-cni: repaired, uninstall gives back the new version",
			// The owner's latest bytes are the ones to restore.
			primary: "10-bridge.conflist", orig: bridge,
			rewrite: func(t *testing.T, e env) { e.write(t, "10-bridge.conflist", bridgeV2) },
			outcome: Repaired,
			want:    map[string][]byte{"10-bridge.conflist": bridgeV2},
		},
		{
			name:    "rewritten keeping aether-cni: left alone, uninstall removes only aether-cni",
			primary: "10-bridge.conflist", orig: bridge,
			rewrite: func(t *testing.T, e env) {
				e.write(t, "10-bridge.conflist", mustInsert(t, bridgeV2))
			},
			outcome: Unchanged,
			want:    map[string][]byte{"10-bridge.conflist": bridgeV2},
		},
		{
			name:    "new lexically-first primary: old one restored, new one chained",
			primary: "10-bridge.conflist", orig: bridge,
			rewrite: func(t *testing.T, e env) { e.write(t, "05-cilium.conflist", primaries(t)["05-cilium.conflist"]) },
			outcome: Chained,
			want:    map[string][]byte{"10-bridge.conflist": bridge, "05-cilium.conflist": primaries(t)["05-cilium.conflist"]},
		},
		{
			name:    "single-plugin primary written again by its owner: converted again",
			primary: "10-bridge.conf", orig: single,
			rewrite: func(t *testing.T, e env) { e.write(t, "10-bridge.conf", singleV2) },
			outcome: Chained,
			want:    map[string][]byte{"10-bridge.conf": singleV2},
			absent:  []string{"10-bridge.conflist"},
		},
		{
			name:    "converted conflist rewritten by someone else keeping aether-cni: stays a conflist without aether-cni",
			primary: "10-bridge.conf", orig: single,
			rewrite: func(t *testing.T, e env) {
				e.write(t, "10-bridge.conflist", mustInsert(t, mustConfToList(t, singleV2)))
			},
			outcome: Unchanged,
			want:    map[string][]byte{"10-bridge.conflist": mustConfToList(t, singleV2)},
			absent:  []string{"10-bridge.conf"},
		},
		{
			name:    "primary deleted: nothing to chain, nothing to restore",
			primary: "10-bridge.conflist", orig: bridge,
			rewrite: func(t *testing.T, e env) {
				if err := os.Remove(filepath.Join(e.conf, "10-bridge.conflist")); err != nil {
					t.Fatal(err)
				}
			},
			outcome: NoPrimary,
			absent:  []string{"10-bridge.conflist"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.write(t, tc.primary, tc.orig)
			i := e.installer(t)
			reconcile(t, i, Chained)
			tc.rewrite(t, e)
			reconcile(t, i, tc.outcome)
			// Then idempotent: nothing left to do.
			settled := Unchanged
			if tc.outcome == NoPrimary {
				settled = NoPrimary
			}
			reconcile(t, i, settled)
			primary, _, err := FindPrimary(e.conf)
			if err != nil {
				t.Fatal(err)
			}
			if primary != nil && !chainEndsWith(primary.List) {
				t.Fatalf("primary %s does not end with aether-cni after reconcile: %v", primary.Path, ChainTypes(primary.List))
			}
			if err := e.installer(t).Uninstall(); err != nil { // a restarted installer
				t.Fatal(err)
			}
			for n, want := range tc.want {
				if got := e.read(t, n); !bytes.Equal(got, want) {
					t.Fatalf("%s after uninstall:\nwant %q\ngot  %q", n, want, got)
				}
			}
			for _, n := range tc.absent {
				mustNotExist(t, filepath.Join(e.conf, n))
			}
			if got, want := len(e.files(t)), len(tc.want); got != want {
				t.Fatalf("conf dir holds %v, want only %d files", e.files(t), want)
			}
		})
	}
}

func mustRead(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func mustInsert(t testing.TB, list []byte) []byte {
	t.Helper()
	out, err := Insert(list, []byte(testEntry))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func mustConfToList(t testing.TB, conf []byte) []byte {
	t.Helper()
	l, err := ConfToList(conf)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestConversionTargetTaken(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-bridge.conf", primaries(t)["10-bridge.conf"])
	e.write(t, "10-bridge.conflist", []byte(list("someone-elses")))
	_, err := e.installer(t).Reconcile()
	if err == nil || !strings.Contains(err.Error(), "10-bridge.conflist") || !strings.Contains(err.Error(), "not written by the installer") {
		t.Fatalf("Reconcile error = %v; want one naming the taken conflist", err)
	}
	if got := string(e.read(t, "10-bridge.conflist")); got != list("someone-elses") {
		t.Fatalf("someone else's conflist was changed: %s", got)
	}
	mustNotExist(t, e.state)
}

func TestNewRejects(t *testing.T) {
	e := newEnv(t)
	base := Config{BinDir: e.bin, ConfDir: e.conf, SourceDir: e.src, StateFile: e.state, Binaries: []string{"aether-cni"}, Entry: []byte(testEntry)}
	for _, tc := range []struct {
		name   string
		mutate func(c *Config)
		want   string
	}{
		{"state in conf dir", func(c *Config) { c.StateFile = filepath.Join(c.ConfDir, "state.json") }, "outside the conf dir"},
		{"relative conf dir", func(c *Config) { c.ConfDir = "etc/cni" }, "must be absolute"},
		{"binary path", func(c *Config) { c.Binaries = []string{"../x"} }, "plain file name"},
		{"entry not object", func(c *Config) { c.Entry = []byte(`[1]`) }, "JSON object"},
		{"entry wrong type", func(c *Config) { c.Entry = []byte(`{"type":"bridge"}`) }, `"type" must be "aether-cni"`},
		{"missing dirs", func(c *Config) { c.BinDir = "" }, "required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.mutate(&c)
			if _, err := New(c, slog.Default()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New error = %v; want one containing %q", err, tc.want)
			}
		})
	}
}

func TestBinaries(t *testing.T) {
	e := newEnv(t)
	src := filepath.Join(e.src, "aether-cni")
	dst := filepath.Join(e.bin, "aether-cni")
	stat := func() fs.FileInfo {
		t.Helper()
		fi, err := os.Stat(dst)
		if err != nil {
			t.Fatal(err)
		}
		return fi
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T)
		wrote bool
	}{
		{"fresh install", func(*testing.T) {}, true},
		{"identical: skipped", func(*testing.T) {}, false},
		{"wrong mode: rewritten", func(t *testing.T) {
			if err := os.Chmod(dst, 0o644); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"new source: replaced", func(t *testing.T) {
			if err := os.WriteFile(src, []byte("#!/bin/sh\n# v2\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.setup(t)
			var before fs.FileInfo
			if _, err := os.Stat(dst); err == nil {
				before = stat()
			}
			wrote, err := CopyBinary(src, dst)
			if err != nil {
				t.Fatal(err)
			}
			if wrote != tc.wrote {
				t.Fatalf("CopyBinary wrote=%v, want %v", wrote, tc.wrote)
			}
			after := stat()
			if after.Mode().Perm() != BinaryMode {
				t.Fatalf("mode %v, want %v", after.Mode().Perm(), BinaryMode)
			}
			if !bytes.Equal(mustRead(t, dst), mustRead(t, src)) {
				t.Fatal("installed binary differs from the source")
			}
			// Replaced by rename (a new inode), never rewritten in place:
			// a runtime executing the old binary keeps its file.
			if before != nil && os.SameFile(before, after) == tc.wrote {
				t.Fatalf("SameFile(before, after) = %v with wrote=%v", os.SameFile(before, after), tc.wrote)
			}
			ents, err := os.ReadDir(e.bin)
			if err != nil {
				t.Fatal(err)
			}
			if len(ents) != 1 {
				t.Fatalf("bin dir holds %d files, want only aether-cni (no temp file left)", len(ents))
			}
		})
	}
	t.Run("remove only what we copied", func(t *testing.T) {
		other := filepath.Join(e.bin, "eni-vlan")
		if err := os.WriteFile(other, []byte("someone else's build"), 0o755); err != nil {
			t.Fatal(err)
		}
		i := e.installer(t)
		if err := i.RemoveBinaries(); err != nil {
			t.Fatal(err)
		}
		mustNotExist(t, dst)
		if got := string(mustRead(t, other)); got != "someone else's build" {
			t.Fatalf("a binary the installer did not copy was changed: %q", got)
		}
		if err := i.RemoveBinaries(); err != nil { // idempotent
			t.Fatal(err)
		}
	})
	t.Run("missing source", func(t *testing.T) {
		_, err := CopyBinary(filepath.Join(e.src, "nope"), filepath.Join(e.bin, "nope"))
		if err == nil || !strings.Contains(err.Error(), "nope") {
			t.Fatalf("CopyBinary error = %v; want one naming the file", err)
		}
	})
}
