// Package oci builds aether-node's container image from the static release
// binaries, without a Docker daemon or a base image, and writes it in the two
// forms the standard tools take: an OCI image layout directory (`crane push`,
// `skopeo copy oci:`) and a tarball (`ctr images import`, `crane push`,
// `docker load`); one image per architecture, or an image index over them
// (Index: the multi-architecture image `make image` writes).
//
// The image is reproducible: the same binaries and the same Spec give the
// same digest. Every tar entry has the Spec's timestamp, uid/gid 0 and no
// user or group names; entries are sorted by path; the config's creation
// time is the same timestamp; nothing reads the clock or the host's users.
package oci

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BinDir is where the binaries live inside the image.
const BinDir = "/usr/local/bin"

// Binaries are the release binaries (cmd/<name>) the aether-node image
// holds in BinDir: `make image` packs them, the tests that build an image
// pack the same list.
var Binaries = []string{"aether-agent", "aether-cni", "aether-cni-install", "aether-csi", "aether-proxy", "aetherctl", "eni-vlan"}

// File is one regular file of the image.
type File struct {
	// Path is the absolute path inside the image, e.g. /usr/local/bin/aether-agent.
	Path string
	// Source is the host file whose bytes the image holds.
	Source string
	// Mode is the file's permission bits (0755 for binaries).
	Mode int64
}

// Spec says what the image holds.
type Spec struct {
	// Files are the image's regular files; parent directories are added.
	Files []File
	// Created is the timestamp of every entry and of the config (for
	// reproducibility: the commit time, or SOURCE_DATE_EPOCH); zero means
	// the Unix epoch.
	Created time.Time
	// OS and Architecture are the platform (default linux / amd64).
	OS, Architecture string
	// Env is the config's environment (PATH is always set to include BinDir).
	Env []string
	// Labels are the config's labels (org.opencontainers.image.*).
	Labels map[string]string
	// Entrypoint is the config's entrypoint (none by default: each
	// container of the DaemonSet names its command).
	Entrypoint []string
}

// Build assembles the image: one layer with the files, /tmp (1777) and the
// parent directories, and a config for the platform.
func Build(spec Spec) (v1.Image, error) {
	if len(spec.Files) == 0 {
		return nil, errors.New("failed to build image: no files given")
	}
	if spec.Created.IsZero() {
		spec.Created = time.Unix(0, 0).UTC()
	}
	layerTar, err := layerBytes(spec)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("failed to make image layer: %w", err)
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer:     layer,
		MediaType: types.OCILayer,
		// Non-empty so the manifest round-trips through JSON unchanged
		// (an empty map would be omitted and read back as nil).
		Annotations: map[string]string{"org.opencontainers.image.title": "aether-node release binaries"},
		History:     v1.History{Created: v1.Time{Time: spec.Created}, CreatedBy: "aether-node tools/image", Comment: "release binaries"},
	})
	if err != nil {
		return nil, fmt.Errorf("failed to append image layer: %w", err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("failed to read image config: %w", err)
	}
	cfg = cfg.DeepCopy()
	cfg.Created = v1.Time{Time: spec.Created}
	cfg.OS = cmpOr(spec.OS, "linux")
	cfg.Architecture = cmpOr(spec.Architecture, "amd64")
	cfg.Config.Env = append([]string{"PATH=" + BinDir + ":/usr/bin:/bin"}, spec.Env...)
	cfg.Config.Labels = spec.Labels
	cfg.Config.WorkingDir = "/"
	cfg.Config.Entrypoint = spec.Entrypoint
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return nil, fmt.Errorf("failed to set image config: %w", err)
	}
	return img, nil
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// layerBytes renders the layer as an uncompressed tar with sorted entries.
func layerBytes(spec Spec) ([]byte, error) {
	type entry struct {
		hdr  *tar.Header
		data []byte
	}
	dirs := map[string]int64{"tmp": 0o1777}
	var entries []entry
	seen := map[string]bool{}
	for _, f := range spec.Files {
		if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
			return nil, fmt.Errorf("failed to add %q to image: the path must be absolute and clean, like %s/aether-agent", f.Path, BinDir)
		}
		p := strings.TrimPrefix(f.Path, "/")
		if seen[p] {
			return nil, fmt.Errorf("failed to add %q to image: listed twice", f.Path)
		}
		seen[p] = true
		data, err := os.ReadFile(f.Source)
		if err != nil {
			return nil, fmt.Errorf("failed to read image file %q: %w", f.Source, err)
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
		}
		entries = append(entries, entry{hdr: &tar.Header{Typeflag: tar.TypeReg, Name: p, Mode: mode, Size: int64(len(data))}, data: data})
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if _, ok := dirs[d]; !ok {
				dirs[d] = 0o755
			}
		}
	}
	for d, mode := range dirs {
		if seen[d] {
			return nil, fmt.Errorf("failed to add %q to image: it is also a parent directory", "/"+d)
		}
		entries = append(entries, entry{hdr: &tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: mode}})
	}
	slices.SortFunc(entries, func(a, b entry) int { return strings.Compare(a.hdr.Name, b.hdr.Name) })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		e.hdr.ModTime = spec.Created.UTC()
		e.hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(e.hdr); err != nil {
			return nil, fmt.Errorf("failed to write image entry %q: %w", e.hdr.Name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, fmt.Errorf("failed to write image entry %q: %w", e.hdr.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("failed to finish image layer: %w", err)
	}
	return buf.Bytes(), nil
}

// Index assembles the multi-architecture image: an OCI image index with one
// entry per image, each carrying its config's platform, ordered by
// architecture (so the same images give the same digest in any order).
// Every image must be of another platform.
func Index(imgs ...v1.Image) (v1.ImageIndex, error) {
	if len(imgs) == 0 {
		return nil, errors.New("failed to build image index: no images given")
	}
	type entry struct {
		img      v1.Image
		platform v1.Platform
	}
	entries := make([]entry, 0, len(imgs))
	for _, img := range imgs {
		cfg, err := img.ConfigFile()
		if err != nil {
			return nil, fmt.Errorf("failed to read image config: %w", err)
		}
		pl := v1.Platform{OS: cfg.OS, Architecture: cfg.Architecture}
		for _, e := range entries {
			if e.platform.Equals(pl) {
				return nil, fmt.Errorf("failed to build image index: two images for %s/%s", pl.OS, pl.Architecture)
			}
		}
		entries = append(entries, entry{img: img, platform: pl})
	}
	slices.SortFunc(entries, func(a, b entry) int {
		return strings.Compare(a.platform.OS+"/"+a.platform.Architecture, b.platform.OS+"/"+b.platform.Architecture)
	})
	adds := make([]mutate.IndexAddendum, len(entries))
	for i, e := range entries {
		pl := e.platform
		adds[i] = mutate.IndexAddendum{Add: e.img, Descriptor: v1.Descriptor{MediaType: types.OCIManifestSchema1, Platform: &pl}}
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	return mutate.AppendManifests(idx, adds...), nil
}

// WriteLayout writes img as an OCI image layout in dir (which must not
// exist or be empty), its index entry annotated with ref so that both
// `ctr images import` (io.containerd.image.name) and OCI tools
// (org.opencontainers.image.ref.name) know its name.
func WriteLayout(dir string, img v1.Image, ref string) error {
	cfg, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("failed to read image config: %w", err)
	}
	return writeLayout(dir, ref, func(p layout.Path, opts ...layout.Option) error {
		return p.AppendImage(img, append(opts, layout.WithPlatform(v1.Platform{OS: cfg.OS, Architecture: cfg.Architecture}))...)
	})
}

// WriteIndexLayout is WriteLayout for a multi-architecture image (Index):
// the layout's one entry is the image index, named ref; `ctr images
// import` unpacks the machine's platform of it, `crane push` pushes them
// all.
func WriteIndexLayout(dir string, idx v1.ImageIndex, ref string) error {
	return writeLayout(dir, ref, func(p layout.Path, opts ...layout.Option) error {
		return p.AppendIndex(idx, opts...)
	})
}

// writeLayout makes an empty OCI image layout in dir and adds its one entry
// with add, annotated with ref's names.
func writeLayout(dir, ref string, add func(p layout.Path, opts ...layout.Option) error) error {
	tag, err := name.NewTag(ref, name.WeakValidation)
	if err != nil {
		return fmt.Errorf("failed to parse image reference %q: %w", ref, err)
	}
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		return fmt.Errorf("failed to write image layout %q: the directory is not empty", dir)
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("failed to create image layout %q: %w", dir, err)
	}
	err = add(p, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          tag.Name(),
		"org.opencontainers.image.ref.name": tag.TagStr(),
	}))
	if err != nil {
		return fmt.Errorf("failed to write image to layout %q: %w", dir, err)
	}
	return nil
}

// WriteTarball writes img as an OCI image layout packed in one tar file (an
// "oci-archive": what `ctr images import` and `skopeo copy oci-archive:`
// read), named ref like WriteLayout, with sorted entries and fixed
// timestamps (the config's creation time), through a temporary file
// renamed into place. The image keeps the digest it has in the layout and
// in a registry.
func WriteTarball(file string, img v1.Image, ref string) error {
	cfg, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("failed to read image config: %w", err)
	}
	return writeTarball(file, cfg.Created.Time, func(dir string) error { return WriteLayout(dir, img, ref) })
}

// WriteIndexTarball is WriteTarball for a multi-architecture image (Index),
// laid out as WriteIndexLayout does; its timestamps are the first image's
// creation time.
func WriteIndexTarball(file string, idx v1.ImageIndex, ref string) error {
	m, err := idx.IndexManifest()
	if err != nil {
		return fmt.Errorf("failed to read image index: %w", err)
	}
	if len(m.Manifests) == 0 {
		return errors.New("failed to write image tarball: the index is empty")
	}
	img, err := idx.Image(m.Manifests[0].Digest)
	if err != nil {
		return fmt.Errorf("failed to read image %s of the index: %w", m.Manifests[0].Digest, err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("failed to read image config: %w", err)
	}
	return writeTarball(file, cfg.Created.Time, func(dir string) error { return WriteIndexLayout(dir, idx, ref) })
}

// writeTarball stages a layout with stage and packs it into file with
// mtime on every entry.
func writeTarball(file string, mtime time.Time, stage func(dir string) error) (err error) {
	dir, err := os.MkdirTemp(filepath.Dir(file), ".oci-stage-")
	if err != nil {
		return fmt.Errorf("failed to stage image tarball %q: %w", file, err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	if err := stage(dir); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), ".oci-archive-")
	if err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err := tarDir(tmp, dir, mtime); err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return fmt.Errorf("failed to write image tarball %q: %w", file, err)
	}
	return nil
}

// tarDir packs the tree under dir into w: entries sorted by path, every
// timestamp mtime, root-owned, 0755 directories and 0644 files.
func tarDir(w io.Writer, dir string, mtime time.Time) error {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			paths = append(paths, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	slices.Sort(paths)
	tw := tar.NewWriter(w)
	for _, p := range paths {
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		st, err := os.Lstat(p)
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), ModTime: mtime.UTC(), Format: tar.FormatPAX}
		switch {
		case st.IsDir():
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", 0o755
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
		case st.Mode().IsRegular():
			hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, 0o644, st.Size()
			if err := tw.WriteHeader(hdr); err != nil {
				return err
			}
			if err := copyFile(tw, p); err != nil {
				return err
			}
		default:
			return fmt.Errorf("unexpected file %q in the image layout", p)
		}
	}
	return tw.Close()
}

func copyFile(w io.Writer, p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}
