// Command image writes aether-node's container image from the static
// release binaries in -bin (see `make image`): an OCI image layout in
// <out>/oci and a tarball <out>/aether-node.tar, both named -ref. No Docker
// daemon and no base image are involved; the same binaries give the same
// digest (entries sorted, timestamps from -created-unix, which `make image`
// takes from SOURCE_DATE_EPOCH or the commit time).
//
// Usage: go run ./tools/image -bin bin -out bin/image -ref localhost/aether-node:dev
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"aether.io/node/tools/image/oci"
)

func main() {
	bin := flag.String("bin", "bin", "directory of the static release binaries (make build)")
	out := flag.String("out", "bin/image", "output directory: <out>/oci (OCI layout) and <out>/aether-node.tar")
	ref := flag.String("ref", "localhost/aether-node:dev", "image reference the outputs are named with")
	created := flag.Int64("created-unix", 0, "timestamp of every entry and of the config, in Unix seconds (reproducibility)")
	arch := flag.String("arch", runtime.GOARCH, "image architecture; must match the binaries (only one per image for now)")
	version := flag.String("version", "dev", "value of the org.opencontainers.image.version label")
	extra := flag.String("extra", "", "comma-separated extra binaries in -bin to include (e.g. aether-cni-install)")
	flag.Parse()

	names := slices.Clone(oci.Binaries)
	for _, e := range strings.Split(*extra, ",") {
		if e = strings.TrimSpace(e); e != "" {
			names = append(names, e)
		}
	}
	files := make([]oci.File, 0, len(names))
	for _, n := range names {
		files = append(files, oci.File{Path: oci.BinDir + "/" + n, Source: filepath.Join(*bin, n), Mode: 0o755})
	}
	img, err := oci.Build(oci.Spec{
		Files:        files,
		Created:      time.Unix(*created, 0).UTC(),
		OS:           "linux",
		Architecture: *arch,
		Labels: map[string]string{
			"org.opencontainers.image.title":   "aether-node",
			"org.opencontainers.image.version": *version,
		},
	})
	if err != nil {
		fail(err)
	}
	layoutDir := filepath.Join(*out, "oci")
	if err := os.RemoveAll(layoutDir); err != nil {
		fail(fmt.Errorf("failed to clear %q: %w", layoutDir, err))
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fail(fmt.Errorf("failed to create %q: %w", *out, err))
	}
	if err := oci.WriteLayout(layoutDir, img, *ref); err != nil {
		fail(err)
	}
	tarPath := filepath.Join(*out, "aether-node.tar")
	if err := oci.WriteTarball(tarPath, img, *ref); err != nil {
		fail(err)
	}
	digest, err := img.Digest()
	if err != nil {
		fail(fmt.Errorf("failed to compute image digest: %w", err))
	}
	fmt.Printf("%s %s\n  layout:  %s\n  tarball: %s\n", *ref, digest, layoutDir, tarPath)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "image:", err)
	os.Exit(1)
}
