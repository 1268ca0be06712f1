package apitest

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/proto"
)

var update = flag.Bool("update", false, "rewrite the golden wire files under testdata/")

// Golden fails unless m's deterministic encoding equals testdata/<name>;
// `go test -update` rewrites the file. The files are the bytes
// test/interop/istio/wire decodes with Istio's own generated types.
func Golden(t *testing.T, name string, m proto.Message) {
	t.Helper()
	got, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatalf("marshal %T: %v", m, err)
	}
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: encoding of %T changed (run go test -update and check test/interop/istio/wire)", path, m)
	}
}
