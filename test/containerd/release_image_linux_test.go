package containerd_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"aether.io/node/test/containerd"
	"aether.io/node/test/harness"
	"aether.io/node/tools/image/oci"
)

// TestReleaseImage: the multi-architecture image `make image` writes
// (tools/image/oci: an index over this machine's architecture and the
// other one, each of its release binaries) is imported by `ctr images
// import` without a registry, the CRI image service (what kubelet asks)
// knows it under its name and with the config digest of this machine's
// image, and its binaries run from it: eni-vlan answers CNI VERSION inside
// a container started by containerd + runc.
func TestReleaseImage(t *testing.T) {
	harness.RequireRoot(t)
	containerd.Need(t, "containerd", "runc", "ctr")
	node := harness.NewNS(t, "ctdimg")
	bins := oci.Binaries
	own := harness.BuildOwn(t, bins...)

	other := "arm64"
	if runtime.GOARCH == other {
		other = "amd64"
	}
	var pkgs []string
	for _, n := range bins {
		pkgs = append(pkgs, "./cmd/"+n)
	}
	foreign := harness.BuildReleaseArch(t, other, pkgs...)

	const ref = "localhost/aether-node:lane"
	image := func(arch, dir string) v1.Image {
		var files []oci.File
		for _, n := range bins {
			files = append(files, oci.File{Path: oci.BinDir + "/" + n, Source: filepath.Join(dir, n), Mode: 0o755})
		}
		img, err := oci.Build(oci.Spec{Files: files, Created: time.Unix(0, 0), Architecture: arch})
		if err != nil {
			t.Fatal(err)
		}
		return img
	}
	img := image(runtime.GOARCH, own)
	idx, err := oci.Index(img, image(other, foreign))
	if err != nil {
		t.Fatal(err)
	}
	tarPath := filepath.Join(t.TempDir(), "aether-node.tar")
	if err := oci.WriteIndexTarball(tarPath, idx, ref); err != nil {
		t.Fatal(err)
	}
	configDigest, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}

	// CRI reports ready only with a loadable network config; this lane
	// never starts a pod sandbox, so a loopback-only list is enough.
	rt := containerd.Start(t, node, t.TempDir(), func(string) string {
		return `{"cniVersion":"1.0.0","name":"lo","plugins":[{"type":"loopback"}]}`
	})
	rt.Import(t, tarPath)
	images := runtimeapi.NewImageServiceClient(rt.Conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := images.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil {
		t.Fatalf("CRI ImageStatus(%s): %v", ref, err)
	}
	if st.GetImage() == nil {
		t.Fatalf("CRI does not know %s after the import", ref)
	}
	if st.GetImage().GetId() != configDigest.String() {
		t.Fatalf("CRI image id = %s, want the config digest %s", st.GetImage().GetId(), configDigest)
	}

	// Run a binary from the image. runc state and the cgroup stay under
	// this containerd's own dirs (cleanupHost removes them on failure).
	id := "img-" + containerd.RandHex(4)
	cmd := exec.Command("ctr", "--address", rt.Sock, "-n", "k8s.io", "run", "--rm",
		"--runc-root", rt.RuncRoot(), "--cgroup", rt.CgroupParent+"/"+id,
		"--env", "CNI_COMMAND=VERSION", ref, id, oci.BinDir+"/eni-vlan")
	cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0"}`)
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = ee.Stderr
		}
		t.Fatalf("ctr run eni-vlan VERSION from the image: %v\n%s%s\n%s", err, out, stderr, rt.Log())
	}
	var v struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal(out, &v); err != nil || len(v.SupportedVersions) == 0 {
		t.Fatalf("eni-vlan VERSION from the image printed %q (%v), want the CNI version JSON", out, err)
	}
	if _, err := os.Stat(filepath.Join(rt.RuncRoot(), id)); !os.IsNotExist(err) {
		t.Fatalf("runc state of the --rm container left behind: %v", err)
	}
}
