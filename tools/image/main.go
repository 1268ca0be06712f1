// Command image writes aether-node's container image from the static
// release binaries (see `make image`): an OCI image layout in <out>/oci and a
// tarball <out>/aether-node.tar, both named -ref. With -bin (and -arch) it
// is one image of the binaries in -bin; with -arch-bin, given once per
// architecture, it is a multi-architecture image: an OCI image index over
// one image per architecture (one or more), each of the binaries in its
// directory. No Docker daemon and no base image are involved; the same
// binaries give the same digest (entries sorted, timestamps from
// -created-unix, which `make image` takes from SOURCE_DATE_EPOCH or the
// commit time). Every binary must be an ELF executable of its image's
// architecture.
//
// Usage:
//
//	go run ./tools/image -bin bin -out bin/image -ref localhost/aether-node:dev
//	go run ./tools/image -arch-bin amd64=bin/linux_amd64 -arch-bin arm64=bin/linux_arm64 -out bin/image -ref localhost/aether-node:dev
package main

import (
	"debug/elf"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"aether.io/node/tools/image/oci"
)

// machines are the ELF machines of the architectures an image can be of.
var machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// archBin is one -arch-bin: an architecture and its binaries' directory.
type archBin struct{ arch, dir string }

func main() {
	bin := flag.String("bin", "bin", "directory of the static release binaries (make build) of a one-architecture image")
	arch := flag.String("arch", runtime.GOARCH, "architecture of the one-architecture image of -bin; must match the binaries")
	var archBins []archBin
	flag.Func("arch-bin", "ARCH=DIR: the binaries of ARCH are in DIR; once per architecture of a multi-architecture image (an OCI image index; not with -bin or -arch)", func(v string) error {
		a, d, ok := strings.Cut(v, "=")
		if !ok || a == "" || d == "" {
			return fmt.Errorf("%q is not ARCH=DIR", v)
		}
		archBins = append(archBins, archBin{arch: a, dir: d})
		return nil
	})
	out := flag.String("out", "bin/image", "output directory: <out>/oci (OCI layout) and <out>/aether-node.tar")
	ref := flag.String("ref", "localhost/aether-node:dev", "image reference the outputs are named with")
	created := flag.Int64("created-unix", 0, "timestamp of every entry and of the config, in Unix seconds (reproducibility)")
	version := flag.String("version", "dev", "value of the org.opencontainers.image.version label")
	extra := flag.String("extra", "", "comma-separated extra binaries in -bin to include (e.g. aether-cni-install)")
	flag.Parse()

	index := len(archBins) > 0
	if index {
		flag.Visit(func(f *flag.Flag) {
			if f.Name == "bin" || f.Name == "arch" {
				fail(fmt.Errorf("-%s and -arch-bin exclude each other: give each architecture's directory with -arch-bin", f.Name))
			}
		})
	} else {
		archBins = []archBin{{arch: *arch, dir: *bin}}
	}
	names := slices.Clone(oci.Binaries)
	for _, e := range strings.Split(*extra, ",") {
		if e = strings.TrimSpace(e); e != "" {
			names = append(names, e)
		}
	}
	imgs := make([]v1.Image, 0, len(archBins))
	for _, ab := range archBins {
		img, err := build(ab, names, time.Unix(*created, 0).UTC(), *version)
		if err != nil {
			fail(err)
		}
		imgs = append(imgs, img)
	}
	layoutDir := filepath.Join(*out, "oci")
	if err := os.RemoveAll(layoutDir); err != nil {
		fail(fmt.Errorf("failed to clear %q: %w", layoutDir, err))
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fail(fmt.Errorf("failed to create %q: %w", *out, err))
	}
	tarPath := filepath.Join(*out, "aether-node.tar")
	var digest v1.Hash
	if index {
		digest = writeIndex(imgs, layoutDir, tarPath, *ref)
	} else {
		digest = write(imgs[0], layoutDir, tarPath, *ref)
	}
	fmt.Printf("%s %s\n  layout:  %s\n  tarball: %s\n", *ref, digest, layoutDir, tarPath)
}

// build makes the image of ab: the binaries names in ab.dir, each checked
// to be an ELF executable of ab.arch.
func build(ab archBin, names []string, created time.Time, version string) (v1.Image, error) {
	files := make([]oci.File, 0, len(names))
	for _, n := range names {
		src := filepath.Join(ab.dir, n)
		if err := checkMachine(src, ab.arch); err != nil {
			return nil, err
		}
		files = append(files, oci.File{Path: oci.BinDir + "/" + n, Source: src, Mode: 0o755})
	}
	return oci.Build(oci.Spec{
		Files:        files,
		Created:      created,
		OS:           "linux",
		Architecture: ab.arch,
		Labels: map[string]string{
			"org.opencontainers.image.title":   "aether-node",
			"org.opencontainers.image.version": version,
		},
	})
}

// checkMachine fails unless the file at path is an ELF executable of arch.
func checkMachine(path, arch string) error {
	want, ok := machines[arch]
	if !ok {
		return fmt.Errorf("no image architecture %q: want one of amd64, arm64", arch)
	}
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("failed to read binary %q as ELF: %w", path, err)
	}
	defer func() { _ = f.Close() }()
	if f.Machine != want {
		return fmt.Errorf("binary %q is for %v, not %s (%v): build it with GOARCH=%s", path, f.Machine, arch, want, arch)
	}
	return nil
}

// write writes the one-architecture image img.
func write(img v1.Image, layoutDir, tarPath, ref string) v1.Hash {
	if err := oci.WriteLayout(layoutDir, img, ref); err != nil {
		fail(err)
	}
	if err := oci.WriteTarball(tarPath, img, ref); err != nil {
		fail(err)
	}
	digest, err := img.Digest()
	if err != nil {
		fail(fmt.Errorf("failed to compute image digest: %w", err))
	}
	return digest
}

// writeIndex writes the multi-architecture image of imgs.
func writeIndex(imgs []v1.Image, layoutDir, tarPath, ref string) v1.Hash {
	idx, err := oci.Index(imgs...)
	if err != nil {
		fail(err)
	}
	if err := oci.WriteIndexLayout(layoutDir, idx, ref); err != nil {
		fail(err)
	}
	if err := oci.WriteIndexTarball(tarPath, idx, ref); err != nil {
		fail(err)
	}
	digest, err := idx.Digest()
	if err != nil {
		fail(fmt.Errorf("failed to compute image index digest: %w", err))
	}
	return digest
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "image:", err)
	os.Exit(1)
}
