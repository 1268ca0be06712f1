package containerd_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"
)

type ociDescriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    map[string]string `json:"platform,omitempty"`
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// writeImage writes an OCI image-layout tarball at out holding one layer
// with the given files (image path → host path), entrypoint entry, named
// ref through the io.containerd.image.name annotation, so `ctr images
// import` registers it under that name without any registry.
func writeImage(t *testing.T, out, ref, entry string, files map[string]string) {
	t.Helper()
	epoch := time.Unix(0, 0)
	var layerTar bytes.Buffer
	tw := tar.NewWriter(&layerTar)
	for dst, src := range files {
		data, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(dst, "/"), Mode: 0o755, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	var layer bytes.Buffer
	zw := gzip.NewWriter(&layer)
	if _, err := zw.Write(layerTar.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	config := mustJSON(map[string]any{
		"architecture": "amd64", "os": "linux", "created": epoch.UTC().Format(time.RFC3339),
		"config": map[string]any{"Entrypoint": []string{entry}, "WorkingDir": "/"},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{digest(layerTar.Bytes())}},
	})
	manifest := mustJSON(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": ociDescriptor{MediaType: "application/vnd.oci.image.config.v1+json", Digest: digest(config), Size: int64(len(config))},
		"layers": []ociDescriptor{{MediaType: "application/vnd.oci.image.layer.v1.tar+gzip", Digest: digest(layer.Bytes()), Size: int64(layer.Len())}},
	})
	index := mustJSON(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
		"manifests": []ociDescriptor{{
			MediaType: "application/vnd.oci.image.manifest.v1+json", Digest: digest(manifest), Size: int64(len(manifest)),
			Annotations: map[string]string{"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref[strings.LastIndex(ref, ":")+1:]},
			Platform:    map[string]string{"architecture": "amd64", "os": "linux"},
		}},
	})
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ow := tar.NewWriter(f)
	put := func(name string, b []byte) {
		if err := ow.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := ow.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := ow.WriteHeader(&tar.Header{Name: d, Mode: 0o755, ModTime: epoch, Typeflag: tar.TypeDir}); err != nil {
			t.Fatal(err)
		}
	}
	put("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	for _, b := range [][]byte{config, manifest, layer.Bytes()} {
		put("blobs/sha256/"+strings.TrimPrefix(digest(b), "sha256:"), b)
	}
	put("index.json", index)
	if err := ow.Close(); err != nil {
		t.Fatal(err)
	}
}
