package arch

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// maxVerbLines is the most lines a verb may take, from `func` to its
// closing brace: one screen, as containernetworking's vlan cmdAdd. A verb
// that needs more is split into named steps (issue 30 item 3).
const maxVerbLines = 80

// verbs are the functions kept on one screen, each named by its package
// directory, receiver type (empty for a function) and name.
var verbs = []struct{ dir, recv, name string }{
	{"meshcni", "Plugin", "Add"},
	{"meshcni", "", "ParseConfig"},
	{"enivlan", "Plugin", "Add"},
	{"agent/app", "", "ParseFlags"},
	{"agent/pods", "Manager", "addPod"},
	{"xds/workload/client", "", "Run"},
}

// funcLines returns the line counts of every declaration of recv.name
// (recv empty for a function) in the non-test Go files of dir, whatever
// their build constraints.
func funcLines(t *testing.T, dir, recv, name string) []int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatalf("failed to list %s: %v", dir, err)
	}
	fset := token.NewFileSet()
	var out []int
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		src, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("failed to read %s: %v", path, err)
		}
		f, err := parser.ParseFile(fset, path, src, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("failed to parse %s: %v", path, err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Name.Name != name || receiver(fd) != recv {
				continue
			}
			out = append(out, fset.Position(fd.End()).Line-fset.Position(fd.Pos()).Line+1)
		}
	}
	return out
}

// receiver returns the name of fd's receiver type, "" for a function.
func receiver(fd *ast.FuncDecl) string {
	if fd.Recv == nil || len(fd.Recv.List) == 0 {
		return ""
	}
	typ := fd.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if id, ok := typ.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

func TestVerbsFitOnOneScreen(t *testing.T) {
	root := moduleRoot(t)
	for _, v := range verbs {
		full := v.name
		if v.recv != "" {
			full = v.recv + "." + v.name
		}
		t.Run(v.dir+"/"+full, func(t *testing.T) {
			lines := funcLines(t, filepath.Join(root, filepath.FromSlash(v.dir)), v.recv, v.name)
			if len(lines) == 0 {
				t.Fatalf("%s not found in %s: renamed or moved? Update the verbs list", full, v.dir)
			}
			for _, n := range lines {
				if n > maxVerbLines {
					t.Errorf("%s in %s is %d lines, more than %d: split it into named steps", full, v.dir, n, maxVerbLines)
				}
			}
		})
	}
}

func TestFuncLines(t *testing.T) {
	dir := t.TempDir()
	src := "package p\n\ntype T struct{}\n\n// M is three lines.\nfunc (*T) M() {\n\t_ = 1\n}\n\nfunc F() {}\n"
	if err := os.WriteFile(filepath.Join(dir, "p.go"), []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := funcLines(t, dir, "T", "M"); len(got) != 1 || got[0] != 3 {
		t.Errorf("T.M: %v lines, want [3]", got)
	}
	if got := funcLines(t, dir, "", "F"); len(got) != 1 || got[0] != 1 {
		t.Errorf("F: %v lines, want [1]", got)
	}
	if got := funcLines(t, dir, "", "M"); len(got) != 0 {
		t.Errorf("M as a function: %v, want none", got)
	}
}
