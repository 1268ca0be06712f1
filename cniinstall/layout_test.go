package cniinstall

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
)

// These tests judge the conf dir with libcni itself, as the runtime loads
// it, never with the installer's own helpers.

// snapshot is a directory tree, byte for byte: every file's mode and
// content, every symlink's text, every directory's mode.
func snapshot(t testing.TB, roots ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, root := range roots {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := d.Info()
			if err != nil {
				return err
			}
			switch {
			case fi.Mode()&fs.ModeSymlink != 0:
				l, err := os.Readlink(path)
				if err != nil {
					return err
				}
				out[path] = "link " + l
			case fi.IsDir():
				out[path] = "dir " + fi.Mode().String()
			default:
				b, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				out[path] = "file " + fi.Mode().String() + " " + string(b)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func sameTree(t testing.TB, what string, got, want map[string]string) {
	t.Helper()
	for p, w := range want {
		if g, ok := got[p]; !ok {
			t.Errorf("%s: %s is missing (want %q)", what, p, w)
		} else if g != w {
			t.Errorf("%s: %s is\n%q\nwant\n%q", what, p, g, w)
		}
	}
	for p, g := range got {
		if _, ok := want[p]; !ok {
			t.Errorf("%s: %s is left over (%q)", what, p, g)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

// runtimeChain is the runtime's view of dir, spelled out independently of
// the installer: go-cni's loadFromConfDir (libcni.ConfFiles, sorted, the
// first file that loads) and then libcni.LoadConfList of that network,
// which is what libcni's own loader gives for the network's name. It
// returns the primary's file and the plugin types of its chain.
func runtimeChain(t testing.TB, dir string) (string, []string) {
	t.Helper()
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	earlierBad := false
	for _, f := range files {
		var l *libcni.NetworkConfigList
		if strings.HasSuffix(f, ".conflist") {
			if l, err = libcni.ConfListFromFile(f); err != nil {
				earlierBad = true
				continue
			}
			// The same network through libcni's loader by name (which,
			// like go-cni, fails on an earlier conflist that does not
			// load, so only without one).
			byName, err := libcni.LoadConfList(dir, l.Name)
			if earlierBad {
				return f, chainOf(l)
			}
			if err != nil {
				t.Fatalf("libcni.LoadConfList(%q, %q): %v", dir, l.Name, err)
			}
			if a, b := chainOf(l), chainOf(byName); !slices.Equal(a, b) {
				// Changed between the two reads (a writer at work): no
				// chain to judge; a caller that waits reads again.
				t.Logf("ConfListFromFile(%s) = %v but LoadConfList = %v", f, a, b)
				return f, nil
			}
		} else {
			c, err := libcni.ConfFromFile(f) //nolint:staticcheck // what go-cni calls
			if err != nil || c.Network.Type == "" {
				earlierBad = true
				continue
			}
			if l, err = libcni.ConfListFromConf(c); err != nil { //nolint:staticcheck // what go-cni calls
				continue
			}
		}
		return f, chainOf(l)
	}
	return "", nil
}

func chainOf(l *libcni.NetworkConfigList) []string {
	var out []string
	for _, p := range l.Plugins {
		out = append(out, p.Network.Type)
	}
	return out
}

// wantChain fails unless the runtime's primary is primary and its chain is
// want (aether-cni last, once).
func wantChain(t testing.TB, dir, primary string, want ...string) {
	t.Helper()
	got, chain := runtimeChain(t, dir)
	if got != filepath.Join(dir, primary) || !slices.Equal(chain, want) {
		t.Fatalf("runtime's primary %s with chain %v; want %s with %v", got, chain, primary, want)
	}
}

func mkdir(t testing.TB, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

func writeFile(t testing.TB, path, data string) {
	t.Helper()
	mkdir(t, filepath.Dir(path))
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func remove(t testing.TB, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
}

func plugin(typ string) string { return `{"type":"` + typ + `"}` + "\n" }

// spec11 is a network in the CNI spec 1.1 layout: a conflist without
// "plugins" (or with extra), its plugin objects in <name>/*.conf.
func spec11(name, extra string) string {
	return `{"cniVersion":"1.1.0","name":"` + name + `"` + extra + `}` + "\n"
}

// TestPluginDirLayout: a primary whose chain libcni builds from the
// network's plugin directory gets aether-cni as the last file there, it
// stays last when the owner adds a later plugin file, and uninstall gives
// back the owner's tree byte for byte. Before, the installer skipped a
// conflist without "plugins" (chaining a later file the runtime never
// uses) and inserted aether-cni inline, before the plugin directory's
// plugins.
func TestPluginDirLayout(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files map[string]string // conf dir relative
		chain []string          // the runtime's chain once installed
		// after: the owner adds files; then the chain is afterChain.
		after      map[string]string
		afterOut   Outcome
		afterChain []string
		// inline: aether-cni goes into the primary's "plugins".
		inline bool
	}{
		{
			name: "no inline plugins, a later conflist",
			files: map[string]string{
				"10-net.conflist": spec11("net", ""), "net/10-bridge.conf": plugin("bridge"), "net/20-portmap.conf": plugin("portmap"),
				"20-other.conflist": list("other"),
			},
			chain:      []string{"bridge", "portmap", "aether-cni"},
			after:      map[string]string{"net/zzzz-late.conf": plugin("tuning")},
			afterOut:   Repaired,
			afterChain: []string{"bridge", "portmap", "tuning", "aether-cni"},
		},
		{
			name: "inline plugins and the plugin directory",
			files: map[string]string{
				"10-net.conflist": spec11("net", `,"plugins":[{"type":"bridge"}]`), "net/30-tuning.conf": plugin("tuning"),
			},
			chain:      []string{"bridge", "tuning", "aether-cni"},
			after:      map[string]string{"net/~last.conf": plugin("bandwidth")},
			afterOut:   Repaired,
			afterChain: []string{"bridge", "tuning", "bandwidth", "aether-cni"},
		},
		{
			name: "a plugin file sorting after the installer's name",
			files: map[string]string{
				"10-net.conflist": spec11("net", ""), "net/zzz-last.conf": plugin("bridge"),
			},
			chain:      []string{"bridge", "aether-cni"},
			after:      map[string]string{"net/00-first.conf": plugin("portmap")},
			afterOut:   Unchanged,
			afterChain: []string{"portmap", "bridge", "aether-cni"},
		},
		{
			name: "loadOnlyInlinedPlugins: the plugin directory is not loaded",
			files: map[string]string{
				"10-net.conflist": spec11("net", `,"loadOnlyInlinedPlugins":true,"plugins":[{"type":"bridge"}]`), "net/30-tuning.conf": plugin("tuning"),
			},
			chain:      []string{"bridge", "aether-cni"},
			after:      map[string]string{"net/zzzz-late.conf": plugin("portmap")},
			afterOut:   Unchanged,
			afterChain: []string{"bridge", "aether-cni"},
			inline:     true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			for n, c := range tc.files {
				writeFile(t, filepath.Join(e.conf, n), c)
			}
			before := snapshot(t, e.conf)
			i := e.installer(t)
			reconcile(t, i, Chained)
			wantChain(t, e.conf, "10-net.conflist", tc.chain...)
			unchanged := []string{"20-other.conflist"}
			if !tc.inline {
				// The primary itself is the owner's: aether-cni is a file
				// of the plugin directory.
				unchanged = append(unchanged, "10-net.conflist")
			}
			for _, n := range unchanged {
				if c, ok := tc.files[n]; ok {
					if got := string(e.read(t, n)); got != c {
						t.Fatalf("%s was changed:\n%s", n, got)
					}
				}
			}
			reconcile(t, e.installer(t), Unchanged) // idempotent, also after a restart
			for n, c := range tc.after {
				writeFile(t, filepath.Join(e.conf, n), c)
			}
			// The owner's tree: its files with their bytes, nothing of ours.
			owner := snapshot(t, e.conf)
			for p := range owner {
				if strings.Contains(p, "aether-cni") {
					delete(owner, p)
				}
			}
			for n, c := range tc.files {
				owner[filepath.Join(e.conf, n)] = "file -rw-r--r-- " + c
			}
			reconcile(t, i, tc.afterOut)
			reconcile(t, i, Unchanged)
			wantChain(t, e.conf, "10-net.conflist", tc.afterChain...)
			if err := e.installer(t).Uninstall(); err != nil {
				t.Fatal(err)
			}
			sameTree(t, "conf dir after uninstall", snapshot(t, e.conf), owner)
			for p := range before {
				if _, ok := owner[p]; !ok {
					t.Fatalf("%s of the original layout is gone", p)
				}
			}
			mustNotExist(t, e.state)
		})
	}
}

// TestPluginDirAppears: a primary chained inline whose network then gets
// a plugin directory with a plugin (loaded after the inline ones): the
// chain moves into the plugin directory and the conflist gets its bytes
// back; when the owner's plugin file goes again, the chain moves back
// inline. Uninstall leaves the owner's tree.
func TestPluginDirAppears(t *testing.T) {
	e := newEnv(t)
	orig := primaries(t)["10-calico.conflist"]
	e.write(t, "10-calico.conflist", orig)
	i := e.installer(t)
	reconcile(t, i, Chained)
	wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "aether-cni")

	writeFile(t, filepath.Join(e.conf, "k8s-pod-network/50-tuning.conf"), plugin("tuning"))
	reconcile(t, i, Chained)
	reconcile(t, i, Unchanged)
	wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "tuning", "aether-cni")
	if got := e.read(t, "10-calico.conflist"); string(got) != string(orig) {
		t.Fatalf("conflist not given back when the chain moved to the plugin directory:\n%s", got)
	}

	remove(t, filepath.Join(e.conf, "k8s-pod-network/50-tuning.conf"))
	owner := snapshot(t, e.conf)
	delete(owner, filepath.Join(e.conf, "k8s-pod-network", "zz-aether-cni.conf"))
	reconcile(t, i, Chained)
	wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "aether-cni")
	if err := i.Uninstall(); err != nil {
		t.Fatal(err)
	}
	sameTree(t, "conf dir after uninstall", snapshot(t, e.conf), owner)
}

// TestSymlinkedPrimary: a conflist that is a symlink stays the same link
// through install, repair and uninstall; the chain is written into its
// target and uninstall gives the target the owner's latest bytes. A
// retargeted link gives the old target back and chains the new one. A
// symlinked single-plugin file gets its link back on uninstall. Before,
// the installer replaced the link by a regular file and never restored it.
func TestSymlinkedPrimary(t *testing.T) {
	calico := primaries(t)["10-calico.conflist"]
	calicoV2 := strings.Replace(string(calico), `"mtu": 0`, `"mtu": 1400`, 1)
	if calicoV2 == string(calico) {
		t.Fatal("test data: no mtu to change")
	}
	for _, tc := range []struct {
		name string
		// link is the symlink's text; target is where it points, both
		// relative to the node's root.
		link, target string
	}{
		{"target outside the conf dir", "../../../var/lib/calico/10-calico.conflist", "var/lib/calico/10-calico.conflist"},
		{"target inside the conf dir (a ConfigMap's ..data)", "..data/10-calico.conflist", "etc/cni/net.d/..2026_01_01/10-calico.conflist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			root := filepath.Dir(filepath.Dir(filepath.Dir(e.conf)))
			target := filepath.Join(root, tc.target)
			writeFile(t, target, string(calico))
			if strings.HasPrefix(tc.link, "..data/") {
				if err := os.Symlink("..2026_01_01", filepath.Join(e.conf, "..data")); err != nil {
					t.Fatal(err)
				}
			}
			link := filepath.Join(e.conf, "10-calico.conflist")
			if err := os.Symlink(tc.link, link); err != nil {
				t.Fatal(err)
			}
			ownerDir := filepath.Dir(target)
			i := e.installer(t)
			reconcile(t, i, Chained)
			wantLink := func(what string) {
				t.Helper()
				if l, err := os.Readlink(link); err != nil || l != tc.link {
					t.Fatalf("%s: %s is no longer the symlink to %s (readlink %q, %v)", what, link, tc.link, l, err)
				}
			}
			wantLink("after install")
			wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "aether-cni")

			// The owner rewrites its file (through the link's target).
			if err := WriteFileAtomic(target, []byte(calicoV2), 0o644); err != nil {
				t.Fatal(err)
			}
			owner := snapshot(t, e.conf, ownerDir)
			reconcile(t, i, Repaired)
			wantLink("after repair")
			wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "aether-cni")

			if err := e.installer(t).Uninstall(); err != nil {
				t.Fatal(err)
			}
			sameTree(t, "after uninstall", snapshot(t, e.conf, ownerDir), owner)
		})
	}

	t.Run("retargeted link", func(t *testing.T) {
		e := newEnv(t)
		owner := t.TempDir()
		a, b := filepath.Join(owner, "a.conflist"), filepath.Join(owner, "b.conflist")
		writeFile(t, a, string(calico))
		writeFile(t, b, calicoV2)
		link := filepath.Join(e.conf, "10-calico.conflist")
		if err := os.Symlink(a, link); err != nil {
			t.Fatal(err)
		}
		i := e.installer(t)
		reconcile(t, i, Chained)
		// The owner points the link elsewhere, in one rename.
		if err := os.Symlink(b, link+".new"); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(link+".new", link); err != nil {
			t.Fatal(err)
		}
		want := snapshot(t, e.conf, owner)
		want[a] = "file -rw-r--r-- " + string(calico)
		reconcile(t, i, Chained)
		if got := string(mustRead(t, a)); got != string(calico) {
			t.Fatalf("the old target still holds the chain:\n%s", got)
		}
		wantChain(t, e.conf, "10-calico.conflist", "calico", "portmap", "bandwidth", "aether-cni")
		if err := i.Uninstall(); err != nil {
			t.Fatal(err)
		}
		sameTree(t, "after uninstall", snapshot(t, e.conf, owner), want)
	})

	t.Run("single-plugin file", func(t *testing.T) {
		e := newEnv(t)
		owner := t.TempDir()
		target := filepath.Join(owner, "10-bridge.conf")
		writeFile(t, target, string(primaries(t)["10-bridge.conf"]))
		link := filepath.Join(e.conf, "10-bridge.conf")
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, e.conf, owner)
		i := e.installer(t)
		reconcile(t, i, Chained)
		wantChain(t, e.conf, "10-bridge.conflist", "bridge", "aether-cni")
		if err := i.Uninstall(); err != nil {
			t.Fatal(err)
		}
		sameTree(t, "after uninstall", snapshot(t, e.conf, owner), before)
	})
}

// TestWatcherPluginDir: with the real fsnotify, the installer becomes
// ready on a primary in the spec 1.1 layout only with aether-cni last in
// the chain libcni builds for it (not on a later file the runtime never
// uses), keeps it last when the owner adds a plugin file to the network's
// plugin directory (a watched directory), and gives the tree back at stop.
func TestWatcherPluginDir(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.conf, "10-net.conflist"), spec11("net", ""))
	writeFile(t, filepath.Join(e.conf, "net/10-bridge.conf"), plugin("bridge"))
	writeFile(t, filepath.Join(e.conf, "20-other.conflist"), list("other"))
	ready := filepath.Join(t.TempDir(), "ready")
	stop := start(t, e, func(c *Config) { c.ReadyFile = ready })
	waitFor(t, "ready", func() bool { _, err := os.Stat(ready); return err == nil })
	wantChain(t, e.conf, "10-net.conflist", "bridge", "aether-cni")

	writeFile(t, filepath.Join(e.conf, "net/zzzz-late.conf"), plugin("tuning"))
	waitFor(t, "aether-cni last again", func() bool {
		_, chain := runtimeChain(t, e.conf)
		return slices.Equal(chain, []string{"bridge", "tuning", "aether-cni"})
	})
	owner := snapshot(t, e.conf)
	for p := range owner {
		if strings.Contains(p, "aether-cni") {
			delete(owner, p)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	sameTree(t, "conf dir after stop", snapshot(t, e.conf), owner)
	mustNotExist(t, ready)
}

// TestWatcherSymlinkTarget: the owner rewrites a symlinked primary's
// target outside the conf dir; the installer sees it (the target's
// directory is watched) and chains it again, keeping the link.
func TestWatcherSymlinkTarget(t *testing.T) {
	e := newEnv(t)
	owner := t.TempDir()
	target := filepath.Join(owner, "10-calico.conflist")
	orig := primaries(t)["10-calico.conflist"]
	writeFile(t, target, string(orig))
	link := filepath.Join(e.conf, "10-calico.conflist")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, e.conf, owner)
	stop := start(t, e, func(c *Config) { c.Resync = time.Hour })
	chainedLink := func() bool {
		l, err := os.Readlink(link)
		_, chain := runtimeChain(t, e.conf)
		return err == nil && l == target && slices.Equal(chain, []string{"calico", "portmap", "bandwidth", "aether-cni"})
	}
	waitFor(t, "chained through the link", chainedLink)
	for round := range 3 {
		if err := WriteFileAtomic(target, orig, 0o644); err != nil {
			t.Fatal(err)
		}
		waitFor(t, fmt.Sprintf("round %d: chained again", round), chainedLink)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	sameTree(t, "after stop", snapshot(t, e.conf, owner), before)
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	begin := time.Now()
	for !cond() {
		if time.Since(begin) > waitDeadline {
			t.Fatalf("%s: not within %v", what, waitDeadline)
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("%s after %v", what, time.Since(begin))
}

// TestWatcherUnreadableLink: a symlinked conf file sorting first whose
// target the installer cannot read (not mounted into its container) may
// be the host runtime's primary: the ready file goes (a failed reconcile
// is not "chained"), and comes back once the link is gone. Before, the
// link was silently passed over and the probe kept passing.
func TestWatcherUnreadableLink(t *testing.T) {
	e := newEnv(t)
	orig := primaries(t)["10-calico.conflist"]
	e.write(t, "10-calico.conflist", orig)
	ready := filepath.Join(t.TempDir(), "ready")
	stop := start(t, e, func(c *Config) { c.ReadyFile = ready })
	isReady := func() bool { _, err := os.Stat(ready); return err == nil }
	waitFor(t, "ready", isReady)
	link := filepath.Join(e.conf, "05-host.conflist")
	if err := os.Symlink("/host-only/05-host.conflist", link); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "not ready with an unreadable first file", func() bool { return !isReady() })
	remove(t, link)
	waitFor(t, "ready again", isReady)
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got := e.read(t, "10-calico.conflist"); string(got) != string(orig) {
		t.Fatalf("after stop:\n%s", got)
	}
}
