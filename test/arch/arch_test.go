package arch

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
)

// module is this module's path.
const module = "aether.io/node"

// pkg is the part of `go list -json` these tests read.
type pkg struct {
	ImportPath string
	Imports    []string
	DepOnly    bool
}

// graph is the non-test import graph of every package of the module and of
// everything they import, as `go list -deps` reports it for this GOOS.
type graph map[string]pkg

var (
	loadOnce sync.Once
	loaded   graph
	loadErr  error
)

// moduleRoot returns the directory holding this module's go.mod.
func moduleRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("failed to run go env GOMOD: %v", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		t.Fatal("failed to find go.mod: not inside a module")
	}
	return filepath.Dir(gomod)
}

// loadGraph runs `go list -deps -json ./...` once per test binary.
func loadGraph(t *testing.T) graph {
	t.Helper()
	root := moduleRoot(t)
	loadOnce.Do(func() {
		cmd := exec.Command("go", "list", "-e", "-deps", "-json=ImportPath,Imports,DepOnly", "./...")
		cmd.Dir = root
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			loadErr = errors.Join(err, errors.New(stderr.String()))
			return
		}
		loaded, loadErr = decodeGraph(bytes.NewReader(out))
	})
	if loadErr != nil {
		t.Fatalf("failed to list packages: %v", loadErr)
	}
	return loaded
}

// decodeGraph reads the stream of JSON objects `go list -json` prints.
func decodeGraph(r io.Reader) (graph, error) {
	g := graph{}
	dec := json.NewDecoder(r)
	for {
		var p pkg
		err := dec.Decode(&p)
		if errors.Is(err, io.EOF) {
			return g, nil
		}
		if err != nil {
			return nil, err
		}
		g[p.ImportPath] = p
	}
}

// under reports whether path is prefix or a package below it.
func under(path, prefix string) bool {
	return path == prefix || strings.HasPrefix(path, prefix+"/")
}

// underAny reports the first of prefixes path is under.
func underAny(path string, prefixes []string) (string, bool) {
	for _, p := range prefixes {
		if under(path, p) {
			return p, true
		}
	}
	return "", false
}

// chain returns the shortest import chain from "from" to a package under one
// of the forbidden prefixes, or nil when there is none.
func (g graph) chain(from string, forbidden []string) []string {
	prev := map[string]string{from: ""}
	queue := []string{from}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		if _, bad := underAny(cur, forbidden); bad && cur != from {
			var path []string
			for p := cur; p != ""; p = prev[p] {
				path = append(path, p)
			}
			slices.Reverse(path)
			return path
		}
		for _, imp := range g[cur].Imports {
			if _, seen := prev[imp]; !seen {
				prev[imp] = cur
				queue = append(queue, imp)
			}
		}
	}
	return nil
}

// modulePackages returns the module's own packages under any of prefixes,
// sorted.
func (g graph) modulePackages(prefixes []string) []string {
	var out []string
	for path, p := range g {
		if p.DepOnly {
			continue
		}
		if _, ok := underAny(path, prefixes); ok {
			out = append(out, path)
		}
	}
	slices.Sort(out)
	return out
}

func mod(paths ...string) []string {
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = module + "/" + p
	}
	return out
}

// plugins are the CNI plugins: their packages and their mains.
var plugins = mod("enivlan", "meshcni", "cmd/eni-vlan", "cmd/aether-cni")

func TestImportBoundaries(t *testing.T) {
	g := loadGraph(t)
	for _, tt := range []struct {
		name      string
		from      []string
		forbidden []string
	}{
		{"agent does not import proxy", mod("agent", "cmd/aether-agent"), mod("proxy")},
		{"proxy does not import agent", mod("proxy", "cmd/aether-proxy"), mod("agent")},
		{"xds imports neither agent nor proxy", mod("xds"), mod("agent", "proxy")},
		{"registry imports neither agent nor proxy", mod("registry"), mod("agent", "proxy")},
		{"CNI plugins import neither agent nor proxy", plugins, mod("agent", "proxy")},
		{"the CSI driver imports neither agent, proxy nor a CNI plugin", mod("csi", "cmd/aether-csi"), append(mod("agent", "proxy"), plugins...)},
		// aetherctl talks to the agent through the admin API's contract
		// only (pkg/adminapi, which the agent's handler serves): it links
		// no agent package, never its server side (store, registry, pods).
		{"aetherctl links no agent package, only the admin contract", mod("ctl", "cmd/aetherctl"), mod("agent", "registry", "proxy")},
		// deploy/chart runs helm (a binary built into the test cache) and
		// links the test harness; generators and tests use it, never a
		// release binary.
		{"release binaries link neither test, deploy nor tools packages", mod("cmd"), mod("test", "deploy", "tools")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			from := g.modulePackages(tt.from)
			if len(from) == 0 {
				t.Fatalf("no packages under %v: the rule names a path that no longer exists", tt.from)
			}
			for _, p := range from {
				if c := g.chain(p, tt.forbidden); c != nil {
					t.Errorf("forbidden import: %s", strings.Join(c, " -> "))
				}
			}
		})
	}
}

// heavy are packages a CNI plugin never needs on its ADD/DEL/CHECK/VERSION
// path. A plugin is exec'd once per pod and verb: everything it links costs
// size and init time on every call. The agent enforces the API's validation
// rules (protovalidate, cel-go); metrics, tracing SDKs, the Kubernetes API
// and etcd belong to the agent; test helpers to tests.
var heavy = append([]string{
	"buf.build/go/protovalidate",
	"github.com/google/cel-go",
	"cel.dev/expr",
	"github.com/prometheus",
	"go.opentelemetry.io/otel/sdk",
	"go.opentelemetry.io/otel/exporters",
	"go.opentelemetry.io/contrib",
	"k8s.io/client-go",
	"k8s.io/apimachinery",
	"k8s.io/api",
	// the CRI API's descriptor costs every plugin start; aether-cni's one
	// CRI call (meshcni/podpid) is encoded by hand.
	"k8s.io/cri-api",
	"go.etcd.io", // etcd client and bbolt
	"gopkg.in/yaml.v2",
	"gopkg.in/yaml.v3",
	"sigs.k8s.io/yaml",
	"go.yaml.in/yaml",
	"testing",
	// plugins' pkg/ip helpers exec iptables and nft; neither plugin calls them.
	"sigs.k8s.io/knftables",
	"github.com/coreos/go-iptables",
	"github.com/safchain/ethtool",
	module + "/api/internal/apitest",
	module + "/enivlan/enivlantest",
	module + "/registry/etcd/etcdtest",
}, mod("test", "registry", "xds")...)

// notForMeshCNI are linked by eni-vlan only through libcni's invoke (the
// OpenTelemetry API, for IPAM delegation); aether-cni delegates nothing.
var notForMeshCNI = []string{
	"go.opentelemetry.io/otel",
	// the buf.validate rules are the agent's: the API's generated code
	// imports validate.proto as an option import only (tools/protogen), so
	// a client links neither its types nor descriptor.proto's.
	"buf.build/gen/go/bufbuild/protovalidate",
	// no protobuf runtime at all, protowire included (its internal/errors
	// imports internal/detrand, which reads the executable at every start):
	// the plugin's messages are plain Go types encoded and decoded by
	// meshcni/agentclient and meshcni/podpid through meshcni/internal/pbwire,
	// so it imports neither the generated aether.cni.v1 package nor the
	// well-known types.
	"google.golang.org/protobuf",
	module + "/api",
	// it calls the agent (and the CRI runtime) through
	// meshcni/internal/grpcwire: grpc-go's init and size cost every exec.
	"google.golang.org/grpc",
	// the readiness probe's GET is written out (pkg/readiness): net/http
	// brings crypto/tls and x509 into every exec.
	"net/http",
}

// notForCSI are the CSI sanity suite and its test framework.
var notForCSI = []string{
	"github.com/kubernetes-csi/csi-test",
	"github.com/onsi/ginkgo",
	"github.com/onsi/gomega",
}

func TestPluginsLinkNothingHeavy(t *testing.T) {
	g := loadGraph(t)
	for _, tt := range []struct {
		main      string
		forbidden []string
	}{
		{module + "/cmd/eni-vlan", heavy},
		{module + "/cmd/aether-cni", append(slices.Clone(heavy), notForMeshCNI...)},
		// The CSI node plugin is a long-lived daemon but a small one: gRPC
		// and the CSI spec, never the sanity suite its tests run.
		{module + "/cmd/aether-csi", append(slices.Clone(heavy), notForCSI...)},
	} {
		t.Run(filepath.Base(tt.main), func(t *testing.T) {
			main := tt.main
			if _, ok := g[main]; !ok {
				t.Fatalf("%s is not in the module's package list", main)
			}
			for _, h := range tt.forbidden {
				if c := g.chain(main, []string{h}); c != nil {
					t.Errorf("links %s, which it never needs at runtime: %s", h, strings.Join(c, " -> "))
				}
			}
		})
	}
}

func TestChainNamesTheImportPath(t *testing.T) {
	g := graph{
		"m/a":   {ImportPath: "m/a", Imports: []string{"m/b", "m/c"}},
		"m/b":   {ImportPath: "m/b", Imports: []string{"m/d/x"}},
		"m/c":   {ImportPath: "m/c"},
		"m/d/x": {ImportPath: "m/d/x"},
		"m/dd":  {ImportPath: "m/dd"},
	}
	for _, tt := range []struct {
		from      string
		forbidden []string
		want      []string
	}{
		{"m/a", []string{"m/d"}, []string{"m/a", "m/b", "m/d/x"}},
		{"m/a", []string{"m/c"}, []string{"m/a", "m/c"}},
		{"m/a", []string{"m/d/x"}, []string{"m/a", "m/b", "m/d/x"}},
		{"m/a", []string{"m/e"}, nil},
		{"m/c", []string{"m/d"}, nil},
		{"m/dd", []string{"m/d"}, nil},
	} {
		if got := g.chain(tt.from, tt.forbidden); !slices.Equal(got, tt.want) {
			t.Errorf("chain(%s, %v) = %v, want %v", tt.from, tt.forbidden, got, tt.want)
		}
	}
}

// layoutRow is one row of the layout table: the paths its first cell names.
type layoutRow struct {
	line  int
	text  string
	paths []string
}

var codeSpan = regexp.MustCompile("`([^`]+)`")

// readLayout returns the rows of the table under "## Layout" in md.
func readLayout(md io.Reader) ([]layoutRow, error) {
	var rows []layoutRow
	in := false
	sc := bufio.NewScanner(md)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "## "):
			in = line == "## Layout"
			continue
		case !in || !strings.HasPrefix(line, "|"):
			continue
		}
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		row := layoutRow{line: n, text: line}
		for _, m := range codeSpan.FindAllStringSubmatch(cells[1], -1) {
			row.paths = append(row.paths, m[1])
		}
		if len(row.paths) > 0 {
			rows = append(rows, row)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, errors.New(`no "## Layout" table with paths`)
	}
	return rows, nil
}

// placeholder matches a <name> in a layout path such as cmd/<binary>/main.go.
var placeholder = regexp.MustCompile(`<[^>]+>`)

// exists reports whether a layout path names something in root; <name>
// placeholders match any one path element.
func exists(root, path string) bool {
	pattern := filepath.Join(root, filepath.FromSlash(placeholder.ReplaceAllString(strings.TrimSuffix(path, "/"), "*")))
	m, err := filepath.Glob(pattern)
	return err == nil && len(m) > 0
}

// topLevelDirs returns the top-level directories of root that hold Go
// packages or docs (a .go or .md file anywhere below them), skipping hidden
// directories, testdata and nested modules' build output.
func topLevelDirs(root string) ([]string, error) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		name := e.Name()
		if !e.IsDir() || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "bin" {
			continue
		}
		found := errors.New("found")
		err := filepath.WalkDir(filepath.Join(root, name), func(_ string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !d.IsDir() && (strings.HasSuffix(d.Name(), ".go") || strings.HasSuffix(d.Name(), ".md")) {
				return found
			}
			return nil
		})
		switch {
		case errors.Is(err, found):
			out = append(out, name)
		case err != nil:
			return nil, err
		}
	}
	return out, nil
}

func TestLayoutTableMatchesTree(t *testing.T) {
	root := moduleRoot(t)
	const doc = "docs/CONTRIBUTING.md"
	f, err := os.Open(filepath.Join(root, doc))
	if err != nil {
		t.Fatalf("failed to open %q: %v", doc, err)
	}
	t.Cleanup(func() { _ = f.Close() })
	rows, err := readLayout(f)
	if err != nil {
		t.Fatalf("failed to read the layout table of %q: %v", doc, err)
	}

	listed := map[string]bool{}
	for _, r := range rows {
		for _, p := range r.paths {
			listed[strings.SplitN(p, "/", 2)[0]] = true
			if !exists(root, p) {
				t.Errorf("%s:%d: the layout table names `%s`, which does not exist: fix or remove the row\n\t%s", doc, r.line, p, r.text)
			}
		}
	}
	dirs, err := topLevelDirs(root)
	if err != nil {
		t.Fatalf("failed to list the top-level directories of %q: %v", root, err)
	}
	for _, d := range dirs {
		if !listed[d] {
			t.Errorf("%s: the layout table has no row for the top-level directory %s/: add\n\t| `%s/` | <what it holds> |", doc, d, d)
		}
	}
}

func TestReadLayout(t *testing.T) {
	md := "# x\n## Layout\nintro `not/a/row`\n| path | what |\n| --- | --- |\n| `a/`, `b/c` | two |\n| `cmd/<binary>/main.go` | mains `x/` |\n## Rules\n| `r/` | not layout |\n"
	rows, err := readLayout(strings.NewReader(md))
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{{"a/", "b/c"}, {"cmd/<binary>/main.go"}}
	if len(rows) != len(want) {
		t.Fatalf("got %d rows %+v, want %d", len(rows), rows, len(want))
	}
	for i, r := range rows {
		if !slices.Equal(r.paths, want[i]) {
			t.Errorf("row %d: paths %v, want %v", i, r.paths, want[i])
		}
	}
	if rows[0].line != 6 {
		t.Errorf("row 0 on line %d, want 6", rows[0].line)
	}
	if _, err := readLayout(strings.NewReader("# no layout\n")); err == nil {
		t.Error("readLayout of a document without a layout table: got nil error")
	}
}

// TestTypeURLsDefinedOnce: the xDS type URLs are spelled once, in
// xds/resource; everything else refers to its constants (generated code
// aside).
func TestTypeURLsDefinedOnce(t *testing.T) {
	root := moduleRoot(t)
	// Split so that this file does not hold the literals it looks for.
	const prefix = `"type.googleapis.com/`
	literals := []string{prefix + `istio.workload.Workload"`, prefix + `envoy.config.listener.v3.Listener"`}
	var found []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); p != root && (strings.HasPrefix(n, ".") || n == "bin" || n == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, ".pb.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		for _, l := range literals {
			if bytes.Contains(b, []byte(l)) {
				found = append(found, rel+": "+l)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		filepath.Join("xds", "resource", "resource.go") + ": " + literals[0],
		filepath.Join("xds", "resource", "resource.go") + ": " + literals[1],
	}
	if !slices.Equal(found, want) {
		t.Fatalf("type URL literals found at %q; want them only in xds/resource (use resource.WorkloadType / resource.ListenerType elsewhere)", found)
	}
}
