package valuesdoc

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		src     string
		want    []Value
		wantErr string
	}{
		{
			name: "nested, multi-line, maps whole, section comments",
			src: `# File header.

image:
  # -- Repository.
  repository: localhost/x
  # Section comment, not a description.
  # -- Tag; empty means
  # the appVersion.
  tag: ""
# -- Resources of the agent.
resources:
  requests:
    cpu: 50m
# -- Args.
args: []
# -- A flag.
on: true
`,
			want: []Value{
				{Key: "image.repository", Default: `"localhost/x"`, Description: "Repository."},
				{Key: "image.tag", Default: `""`, Description: "Tag; empty means the appVersion."},
				{Key: "resources", Default: `{"requests":{"cpu":"50m"}}`, Description: "Resources of the agent."},
				{Key: "args", Default: `[]`, Description: "Args."},
				{Key: "on", Default: `true`, Description: "A flag."},
			},
		},
		{name: "undocumented leaf", src: "a:\n  # -- ok\n  b: 1\n  c: 2\n", wantErr: `value "a.c" (line 4) has no description`},
		{name: "plain comment is not a description", src: "# just a comment\nx: 1\n", wantErr: `value "x" (line 2) has no description`},
		{name: "undocumented empty map", src: "m: {}\n", wantErr: `value "m" (line 1) has no description`},
		{name: "not a map", src: "- a\n", wantErr: "not a map"},
		{name: "empty", src: "", want: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse([]byte(tt.src))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Parse error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("Parse =\n%+v\nwant\n%+v", got, tt.want)
			}
		})
	}
}

func TestTable(t *testing.T) {
	got := string(Table([]Value{
		{Key: "a.b", Default: `"x"`, Description: "Plain."},
		{Key: "c", Default: `"p|q"`, Description: "Either `a` | `b`."},
		{Key: "d", Default: "\"`\"", Description: "Backtick."},
	}))
	want := "| value | default | description |\n| --- | --- | --- |\n" +
		"| `a.b` | `\"x\"` | Plain. |\n" +
		"| `c` | `\"p\\|q\"` | Either `a` \\| `b`. |\n" +
		"| `d` | ``\"`\"`` | Backtick. |\n"
	if got != want {
		t.Fatalf("Table =\n%s\nwant\n%s", got, want)
	}
}

func TestSplice(t *testing.T) {
	doc := []byte("# Doc\n\n" + BeginMarker + "\nold table\n" + EndMarker + "\n\nafter\n")
	got, err := Splice(doc, []byte("| new |\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := "# Doc\n\n" + BeginMarker + "\n| new |\n" + EndMarker + "\n\nafter\n"
	if string(got) != want {
		t.Fatalf("Splice =\n%s\nwant\n%s", got, want)
	}
	again, err := Splice(got, []byte("| new |\n"))
	if err != nil || !bytes.Equal(again, got) {
		t.Fatalf("Splice is not idempotent: %v\n%s", err, again)
	}
	for _, bad := range []string{"no markers\n", EndMarker + "\n" + BeginMarker + "\n", BeginMarker + "\n"} {
		if _, err := Splice([]byte(bad), nil); err == nil {
			t.Errorf("Splice(%q): got nil error, want the missing markers named", bad)
		}
	}
}

// TestChartValues checks every value of the real chart is documented and
// docs/install.md carries the table generated from them (`make generate`).
func TestChartValues(t *testing.T) {
	root := filepath.Join("..", "..", "..")
	src, err := os.ReadFile(filepath.Join(root, "deploy", "chart", "aether-node", "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	vs, err := Parse(src)
	if err != nil {
		t.Fatal(err)
	}
	if len(vs) < 20 {
		t.Fatalf("the chart documents %d values; want every value of values.yaml", len(vs))
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "install.md"))
	if err != nil {
		t.Fatal(err)
	}
	want, err := Splice(doc, Table(vs))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(doc, want) {
		t.Error("docs/install.md's values table is stale: run `make generate`")
	}
}
