package oci_test

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"

	"aether.io/node/tools/image/oci"
)

func files(t *testing.T) []oci.File {
	t.Helper()
	dir := t.TempDir()
	var fs []oci.File
	for _, n := range []string{"zeta", "alpha", "mid"} {
		src := filepath.Join(dir, n)
		if err := os.WriteFile(src, []byte("#!binary "+n), 0o600); err != nil {
			t.Fatal(err)
		}
		fs = append(fs, oci.File{Path: oci.BinDir + "/" + n, Source: src, Mode: 0o755})
	}
	return fs
}

var created = time.Unix(1764460800, 0).UTC()

// TestReproducible: the same inputs give the same digest and byte-identical
// tarballs, and what is written reads back as a valid image.
func TestReproducible(t *testing.T) {
	fs := files(t)
	out := t.TempDir()
	var digests []string
	var tarballs [][]byte
	for i := range 2 {
		// Different order of the inputs and a different mtime on disk
		// must not matter.
		in := slices.Clone(fs)
		if i == 1 {
			slices.Reverse(in)
			for _, f := range in {
				if err := os.Chtimes(f.Source, time.Now(), time.Now()); err != nil {
					t.Fatal(err)
				}
			}
		}
		img, err := oci.Build(oci.Spec{Files: in, Created: created, Labels: map[string]string{"org.opencontainers.image.version": "v1"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := validate.Image(img); err != nil {
			t.Fatalf("invalid image: %v", err)
		}
		d, err := img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d.String())
		p := filepath.Join(out, "img.tar")
		if err := oci.WriteTarball(p, img, "localhost/aether-node:dev"); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		tarballs = append(tarballs, b)
		if bd := untarDigest(t, p); bd != d.String() {
			t.Fatalf("tarball reads back as %s, built %s", bd, d)
		}
	}
	if digests[0] != digests[1] {
		t.Fatalf("digests differ: %v", digests)
	}
	if !bytes.Equal(tarballs[0], tarballs[1]) {
		t.Fatal("tarballs of the same image differ")
	}
}

// TestLayer: sorted entries, fixed timestamps, root-owned, parents and /tmp.
func TestLayer(t *testing.T) {
	img, err := oci.Build(oci.Spec{Files: files(t), Created: created})
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers = %d, %v; want 1", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	var names []string
	modes := map[string]int64{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		modes[h.Name] = h.Mode
		if !h.ModTime.Equal(created) || h.Uid != 0 || h.Gid != 0 || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: mtime %v uid %d gid %d uname %q gname %q; want %v, root, no names", h.Name, h.ModTime, h.Uid, h.Gid, h.Uname, h.Gname, created)
		}
	}
	want := []string{"tmp/", "usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/alpha", "usr/local/bin/mid", "usr/local/bin/zeta"}
	if !slices.Equal(names, want) {
		t.Fatalf("entries = %v, want %v (sorted)", names, want)
	}
	if modes["tmp/"] != 0o1777 || modes["usr/local/bin/alpha"] != 0o755 || modes["usr/"] != 0o755 {
		t.Fatalf("modes = %v", modes)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.Created.Equal(created) || cfg.OS != "linux" || cfg.Architecture != "amd64" || !slices.Contains(cfg.Config.Env, "PATH="+oci.BinDir+":/usr/bin:/bin") {
		t.Fatalf("config = %+v", cfg)
	}
}

// TestLayout: the OCI layout names the image for containerd and OCI tools.
func TestLayout(t *testing.T) {
	img, err := oci.Build(oci.Spec{Files: files(t), Created: created})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "oci")
	if err := oci.WriteLayout(dir, img, "localhost/aether-node:v1.2.3"); err != nil {
		t.Fatal(err)
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 1 {
		t.Fatalf("index has %d manifests, want 1", len(m.Manifests))
	}
	d := m.Manifests[0]
	want, _ := img.Digest()
	if d.Digest != want || d.Annotations["io.containerd.image.name"] != "localhost/aether-node:v1.2.3" ||
		d.Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" || d.Platform == nil || d.Platform.Architecture != "amd64" {
		t.Fatalf("index entry = %+v", d)
	}
	if err := oci.WriteLayout(dir, img, "localhost/aether-node:v1.2.3"); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("second write into a non-empty layout: %v, want a 'not empty' error", err)
	}
}

// TestIndex: the multi-architecture image is an OCI image index with one
// entry per architecture, in a fixed order, each naming its platform; it is
// laid out and packed under its name with one digest however its images
// are given, and two images of one platform are refused.
func TestIndex(t *testing.T) {
	fs := files(t)
	imgs := map[string]v1.Image{}
	for _, arch := range []string{"amd64", "arm64"} {
		img, err := oci.Build(oci.Spec{Files: fs, Created: created, Architecture: arch})
		if err != nil {
			t.Fatal(err)
		}
		imgs[arch] = img
	}
	idx, err := oci.Index(imgs["arm64"], imgs["amd64"])
	if err != nil {
		t.Fatal(err)
	}
	if err := validate.Index(idx); err != nil {
		t.Fatalf("invalid index: %v", err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if m.MediaType != types.OCIImageIndex || len(m.Manifests) != 2 {
		t.Fatalf("index %s with %d manifests, want an OCI image index of 2", m.MediaType, len(m.Manifests))
	}
	for i, arch := range []string{"amd64", "arm64"} {
		d := m.Manifests[i]
		want, _ := imgs[arch].Digest()
		if d.Digest != want || d.MediaType != types.OCIManifestSchema1 || d.Platform == nil || d.Platform.OS != "linux" || d.Platform.Architecture != arch {
			t.Errorf("entry %d = %+v, want the %s image (%s)", i, d, arch, want)
		}
	}
	digest, _ := idx.Digest()
	other, err := oci.Index(imgs["amd64"], imgs["arm64"])
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := other.Digest(); d != digest {
		t.Errorf("index digest %s depends on the order of its images (%s)", d, digest)
	}

	dir := filepath.Join(t.TempDir(), "oci")
	if err := oci.WriteIndexLayout(dir, idx, "localhost/aether-node:v1.2.3"); err != nil {
		t.Fatal(err)
	}
	top, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil || len(tm.Manifests) != 1 {
		t.Fatalf("layout index: %v, %v; want one entry", tm, err)
	}
	if e := tm.Manifests[0]; e.Digest != digest || e.MediaType != types.OCIImageIndex ||
		e.Annotations["io.containerd.image.name"] != "localhost/aether-node:v1.2.3" || e.Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" {
		t.Fatalf("layout entry = %+v, want the index %s named localhost/aether-node:v1.2.3", e, digest)
	}
	var tarballs [][]byte
	for range 2 {
		p := filepath.Join(t.TempDir(), "aether-node.tar")
		if err := oci.WriteIndexTarball(p, idx, "localhost/aether-node:v1.2.3"); err != nil {
			t.Fatal(err)
		}
		if d := untarDigest(t, p); d != digest.String() {
			t.Fatalf("tarball reads back as %s, built %s", d, digest)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		tarballs = append(tarballs, b)
	}
	if !bytes.Equal(tarballs[0], tarballs[1]) {
		t.Error("tarballs of the same index differ")
	}

	if _, err := oci.Index(imgs["amd64"], imgs["amd64"]); err == nil || !strings.Contains(err.Error(), "two images for linux/amd64") {
		t.Errorf("index of two amd64 images: %v, want a 'two images for linux/amd64' error", err)
	}
	if _, err := oci.Index(); err == nil || !strings.Contains(err.Error(), "no images") {
		t.Errorf("index of nothing: %v, want a 'no images' error", err)
	}
}

// TestBadSpec: each refusal says what was wrong.
func TestBadSpec(t *testing.T) {
	fs := files(t)
	for _, tc := range []struct {
		name  string
		files []oci.File
		want  string
	}{
		{"none", nil, "no files"},
		{"relative", []oci.File{{Path: "usr/bin/x", Source: fs[0].Source}}, "absolute and clean"},
		{"unclean", []oci.File{{Path: "/usr/../bin/x", Source: fs[0].Source}}, "absolute and clean"},
		{"twice", []oci.File{fs[0], fs[0]}, "listed twice"},
		{"missing", []oci.File{{Path: "/bin/x", Source: "/nonexistent/x"}}, "failed to read image file"},
		{"file is a parent", []oci.File{{Path: "/usr", Source: fs[0].Source}, fs[1]}, "parent directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := oci.Build(oci.Spec{Files: tc.files, Created: created})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// untarDigest unpacks an oci-archive and returns the digest of its one image.
func untarDigest(t *testing.T, file string) string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dir := t.TempDir()
	tr := tar.NewReader(f)
	var prev string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name <= prev {
			t.Fatalf("tarball entries not sorted: %q after %q", h.Name, prev)
		}
		prev = h.Name
		dst := filepath.Join(dir, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(dst, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil || len(m.Manifests) != 1 {
		t.Fatalf("index: %v, %v", m, err)
	}
	return m.Manifests[0].Digest.String()
}
