package chart

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestDir(t *testing.T) {
	if _, err := os.Stat(filepath.Join(Dir(), "Chart.yaml")); err != nil {
		t.Fatalf("Dir() %s holds no Chart.yaml: %v", Dir(), err)
	}
}

func TestRender(t *testing.T) {
	ctx := context.Background()
	out, err := Render(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: DaemonSet", "namespace: " + Namespace, "name: " + Release} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("default render lacks %q", want)
		}
	}
	m, err := Manifest(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m, append([]byte(ManifestHeader), out...)) {
		t.Error("Manifest is not ManifestHeader followed by the default render")
	}
	// Later values files win, as with helm's own --values.
	dir := t.TempDir()
	first, second := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
	if err := os.WriteFile(first, []byte("clusterID: first\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(second, []byte("clusterID: second\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = Render(ctx, first, second)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(out, []byte("--cluster-id=second")) || bytes.Contains(out, []byte("--cluster-id=first")) {
		t.Error("the last values file does not win")
	}
	// Errors carry helm's message.
	_, err = Render(ctx, filepath.Join(dir, "missing.yaml"))
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Fatalf("render with a missing values file: error %v, want helm's message naming the file", err)
	}
}
