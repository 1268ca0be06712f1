package cniinstall

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

const testEntry = `{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock"}`

// primaries returns the real-looking primaries of testdata/primaries.
func primaries(t testing.TB) map[string][]byte {
	t.Helper()
	ents, err := os.ReadDir("testdata/primaries")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("testdata/primaries", e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = b
	}
	if len(out) < 10 {
		t.Fatalf("testdata/primaries holds %d files, want the whole table", len(out))
	}
	return out
}

func pluginTypes(t *testing.T, data []byte) []string {
	t.Helper()
	var l struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(data, &l); err != nil {
		t.Fatalf("chained conflist is not valid JSON: %v\n%s", err, data)
	}
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p.Type)
	}
	return types
}

func TestInsertRemove(t *testing.T) {
	for name, orig := range primaries(t) {
		t.Run(name, func(t *testing.T) {
			list := orig
			if !isList(name) {
				list = mustConfToList(t, orig)
			}
			had, err := HasPlugin(list)
			if err != nil {
				t.Fatal(err)
			}
			chained, err := Insert(list, []byte(testEntry))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := libcni.NetworkConfFromBytes(chained); err != nil {
				t.Fatalf("chained conflist does not load in libcni: %v\n%s", err, chained)
			}
			types := pluginTypes(t, chained)
			if !had && types[len(types)-1] != PluginType {
				t.Fatalf("plugin types %v: want %s last", types, PluginType)
			}
			if had && !bytes.Equal(chained, list) {
				t.Fatalf("Insert into a conflist that already chains aether-cni changed it:\n%s", chained)
			}
			again, err := Insert(chained, []byte(testEntry))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again, chained) {
				t.Fatalf("Insert is not idempotent:\nfirst:\n%s\nsecond:\n%s", chained, again)
			}
			if had {
				return
			}
			back, removed, err := Remove(chained)
			if err != nil {
				t.Fatal(err)
			}
			if !removed || !bytes.Equal(back, list) {
				t.Fatalf("Remove(Insert(x)) != x (removed=%v):\nwant:\n%q\ngot:\n%q", removed, list, back)
			}
			golden := filepath.Join("testdata/chained", name+".golden")
			if *update {
				if err := os.MkdirAll(filepath.Dir(golden), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(golden, chained, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test ./cniinstall -update)", err)
			}
			if !bytes.Equal(chained, want) {
				t.Fatalf("chained %s differs from %s:\n%s", name, golden, chained)
			}
		})
	}
}

func TestRemove(t *testing.T) {
	const a, b = `{"type":"bridge"}`, `{"type":"aether-cni"}`
	for _, tc := range []struct {
		name, in, want string
		removed        bool
	}{
		{"last", `{"plugins": [` + a + `, ` + b + `]}`, `{"plugins": [` + a + `]}`, true},
		{"first", `{"plugins": [` + b + `, ` + a + `]}`, `{"plugins": [` + a + `]}`, true},
		{"middle", `{"plugins":[` + a + `,` + b + `,{"type":"portmap"}]}`, `{"plugins":[` + a + `,{"type":"portmap"}]}`, true},
		{"several", `{"plugins":[` + b + `,` + b + `,` + a + `,` + b + `]}`, `{"plugins":[` + a + `]}`, true},
		{"only", `{"plugins": [ ` + b + ` ]}`, `{"plugins": [ ]}`, true},
		{"none", `{"plugins": [` + a + `]}`, `{"plugins": [` + a + `]}`, false},
		{"nested plugins key untouched", `{"x":{"plugins":[` + b + `]},"plugins":[` + a + `,` + b + `]}`, `{"x":{"plugins":[` + b + `]},"plugins":[` + a + `]}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, removed, err := Remove([]byte(tc.in))
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want || removed != tc.removed {
				t.Fatalf("Remove(%s) = %s, %v; want %s, %v", tc.in, got, removed, tc.want, tc.removed)
			}
		})
	}
}

func TestLayoutRejects(t *testing.T) {
	for _, in := range []string{
		``, `[]`, `{"plugins": {}}`, `{"name":"x"}`, `{"plugins":[1]}`, `{"plugins":[]} trailing`, `{"plugins":[{"type":"a"}]`,
	} {
		if _, err := Insert([]byte(in), []byte(testEntry)); err == nil {
			t.Errorf("Insert(%q) succeeded; want an error", in)
		}
	}
}

func TestFindPrimary(t *testing.T) {
	for _, tc := range []struct {
		name    string
		files   map[string]string
		want    string
		skipped int
	}{
		{"empty", nil, "", 0},
		{"lexical first wins", map[string]string{"20-b.conflist": list("b"), "10-a.conflist": list("a")}, "10-a.conflist", 0},
		{"conf and json count", map[string]string{"30-c.conflist": list("c"), "05-x.json": `{"name":"x","type":"bridge"}`}, "05-x.json", 0},
		{"other extensions ignored", map[string]string{"01-a.conflist.bak": list("a"), ".aether-cni-install-1.tmp": list("t"), "10-b.conflist": list("b")}, "10-b.conflist", 0},
		{"invalid skipped", map[string]string{"01-bad.conflist": `{`, "02-noplugins.conflist": `{"name":"n","plugins":[]}`, "03-notype.conf": `{"name":"n"}`, "09-ok.conflist": list("ok")}, "09-ok.conflist", 3},
		{"only invalid", map[string]string{"01-bad.conflist": `nope`}, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, c := range tc.files {
				if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			p, skipped, err := FindPrimary(dir)
			if err != nil {
				t.Fatal(err)
			}
			got := ""
			if p != nil {
				got = p.Path
			}
			if tc.want != "" {
				tc.want = filepath.Join(dir, tc.want)
			}
			if got != tc.want || len(skipped) != tc.skipped {
				t.Fatalf("FindPrimary = %q, %d skipped (%v); want %q, %d", got, len(skipped), skipped, tc.want, tc.skipped)
			}
		})
	}
}

func list(name string) string {
	return `{"cniVersion":"1.0.0","name":"` + name + `","plugins":[{"type":"bridge"}]}`
}

func TestRepeatedPluginsKey(t *testing.T) {
	// libcni decodes into a map: the last "plugins" wins; so do we.
	in := `{"name":"n","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}`
	got, err := Insert([]byte(in), []byte(`{"type":"aether-cni"}`))
	if err != nil {
		t.Fatal(err)
	}
	want := `{"name":"n","plugins":[{"type":"a"}],"plugins":[{"type":"b"},{"type":"aether-cni"}]}`
	if string(got) != want {
		t.Fatalf("Insert = %s, want %s", got, want)
	}
}

// TestFindPrimarySpec11: the primary is chosen with libcni's loader, so a
// conflist whose plugins are in its network's plugin directory (CNI spec
// 1.1) is a primary, one without any plugin is skipped, and a symlink the
// installer cannot read stops the choice (the runtime on the host may read
// it).
func TestFindPrimarySpec11(t *testing.T) {
	for _, tc := range []struct {
		name    string
		files   map[string]string
		links   map[string]string
		want    string
		chain   []string
		skipped int
		err     string
	}{
		{
			name:  "plugins only in the plugin directory",
			files: map[string]string{"10-net.conflist": spec11("net", ""), "net/10-bridge.conf": plugin("bridge"), "net/20-portmap.conf": plugin("portmap"), "20-b.conflist": list("b")},
			want:  "10-net.conflist", chain: []string{"bridge", "portmap"},
		},
		{
			name:  "inline plugins first, then the plugin directory",
			files: map[string]string{"10-net.conflist": spec11("net", `,"plugins":[{"type":"ptp"}]`), "net/10-bridge.conf": plugin("bridge")},
			want:  "10-net.conflist", chain: []string{"ptp", "bridge"},
		},
		{
			name:  "loadOnlyInlinedPlugins ignores the plugin directory",
			files: map[string]string{"10-net.conflist": spec11("net", `,"loadOnlyInlinedPlugins":true,"plugins":[{"type":"ptp"}]`), "net/10-bridge.conf": plugin("bridge")},
			want:  "10-net.conflist", chain: []string{"ptp"},
		},
		{
			name:  "only .conf files of the plugin directory count",
			files: map[string]string{"10-net.conflist": spec11("net", ""), "net/10-bridge.json": plugin("bridge"), "20-b.conflist": list("b")},
			want:  "20-b.conflist", chain: []string{"bridge"}, skipped: 1,
		},
		{
			name:  "no plugins anywhere: skipped",
			files: map[string]string{"10-net.conflist": spec11("net", ""), "20-b.conflist": list("b")},
			want:  "20-b.conflist", chain: []string{"bridge"}, skipped: 1,
		},
		{
			name:  "an invalid plugin file: the network does not load",
			files: map[string]string{"10-net.conflist": spec11("net", ""), "net/10-bad.conf": `{"name":"x"}`, "20-b.conflist": list("b")},
			want:  "20-b.conflist", chain: []string{"bridge"}, skipped: 1,
		},
		{
			name:  "a symlinked conflist loads through its link",
			files: map[string]string{"real/10-a.conflist": list("a")},
			links: map[string]string{"10-a.conflist": "real/10-a.conflist"},
			want:  "10-a.conflist", chain: []string{"bridge"},
		},
		{
			name:  "a dangling symlink first: no primary can be told",
			files: map[string]string{"20-b.conflist": list("b")},
			links: map[string]string{"10-a.conflist": "/nonexistent/10-a.conflist"},
			err:   "a symlink whose target the installer cannot read",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, c := range tc.files {
				writeFile(t, filepath.Join(dir, n), c)
			}
			for n, target := range tc.links {
				if err := os.Symlink(target, filepath.Join(dir, n)); err != nil {
					t.Fatal(err)
				}
			}
			p, skipped, err := FindPrimary(dir)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("FindPrimary error = %v; want one saying %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p == nil || p.Path != filepath.Join(dir, tc.want) || !slices.Equal(ChainTypes(p.List), tc.chain) || len(skipped) != tc.skipped {
				t.Fatalf("FindPrimary = %+v, %d skipped (%v); want %s with %v, %d skipped", p, len(skipped), skipped, tc.want, tc.chain, tc.skipped)
			}
			// The runtime's choice, spelled out with libcni in the test.
			if got, chain := runtimeChain(t, dir); got != p.Path || !slices.Equal(chain, tc.chain) {
				t.Fatalf("runtime's primary %s %v; FindPrimary %s %v", got, chain, p.Path, tc.chain)
			}
		})
	}
}

// TestPluginFileName: the installer's plugin file sorts after every other.
func TestPluginFileName(t *testing.T) {
	for _, others := range [][]string{nil, {"10-a.conf"}, {"zz-aether-cni.conf"}, {"zzz.conf"}, {"10-a.conf", "~~.conf"}, {"\u00e9.conf"}} {
		name := pluginFileName(others)
		for _, o := range others {
			if name <= o {
				t.Errorf("pluginFileName(%q) = %q, not after %q", others, name, o)
			}
		}
		if filepath.Ext(name) != ".conf" || strings.ContainsRune(name, '/') {
			t.Errorf("pluginFileName(%q) = %q: want a .conf file name", others, name)
		}
	}
}
