package csi

import (
	"context"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/test/harness"
)

// mountedDriver returns a driver on the kernel's mount table (the test
// binary's private mount namespace, see TestMain) and unmounts anything left
// under its kubelet dir when the test ends.
func mountedDriver(t *testing.T) (*Driver, Config) {
	t.Helper()
	harness.RequireRoot(t)
	d, cfg := testDriver(t, NewMounter())
	t.Cleanup(func() {
		mps, err := NewMounter().MountPoints()
		if err != nil {
			t.Error(err)
			return
		}
		for _, mp := range slices.Backward(mps) {
			if within(cfg.KubeletDir, mp) {
				if err := syscall.Unmount(mp, 0); err != nil {
					t.Errorf("failed to unmount %q left by the test: %v", mp, err)
				}
			}
		}
	})
	return d, cfg
}

// target returns a target path under the kubelet dir for pod uid's volume.
// kubelet's own (<dir>/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount)
// is shortened so a socket path through it fits sun_path in a temp dir.
func target(cfg Config, uid, volume string) string {
	return filepath.Join(cfg.KubeletDir, "p", uid[:8], volume, "mount")
}

func publish(t *testing.T, d *Driver, req *csipb.NodePublishVolumeRequest) {
	t.Helper()
	if _, err := d.NodePublishVolume(context.Background(), req); err != nil {
		t.Fatalf("NodePublishVolume(%s): %v", req.GetTargetPath(), err)
	}
}

func unpublish(t *testing.T, d *Driver, target string) {
	t.Helper()
	if _, err := d.NodeUnpublishVolume(context.Background(), &csipb.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}); err != nil {
		t.Fatalf("NodeUnpublishVolume(%s): %v", target, err)
	}
}

// mountCount counts the mount points at path.
func mountCount(t *testing.T, path string) int {
	t.Helper()
	mps, err := NewMounter().MountPoints()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mp := range mps {
		if mp == path {
			n++
		}
	}
	return n
}

// listenIn creates a unix socket in dir as the app would; the app exits
// (closes it) before kubelet unpublishes its volume.
func listenIn(t *testing.T, dir, name string) net.Listener {
	t.Helper()
	l, err := net.Listen("unix", filepath.Join(dir, name))
	if err != nil {
		t.Fatalf("failed to listen in %s: %v", dir, err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// dial connects to the socket at path as aether-proxy would.
func dial(t *testing.T, path string) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("failed to dial %s: %v", path, err)
	}
	_ = c.Close()
}

func assertGone(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("%s still exists (%v)", path, err)
	}
}

func TestPublishBindsThePodDir(t *testing.T) {
	for _, tc := range []struct {
		name     string
		group    string
		wantMode fs.FileMode
		wantGID  uint32
	}{
		{"no mount group", "", PodDirMode, 0},
		{"fsGroup as volume mount group", "4321", GroupPodDirMode, 4321},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, cfg := mountedDriver(t)
			tgt := target(cfg, testUID, "sock")
			req := publishReq(tgt, testUID)
			req.VolumeCapability.GetMount().VolumeMountGroup = tc.group
			publish(t, d, req)

			dir := filepath.Join(cfg.Root, testUID)
			fi, err := os.Lstat(dir)
			if err != nil {
				t.Fatal(err)
			}
			if got := fi.Mode() & (fs.ModePerm | fs.ModeSticky | fs.ModeSetgid); got != tc.wantMode || !fi.IsDir() {
				t.Errorf("pod dir mode %v, want directory %v", fi.Mode(), tc.wantMode)
			}
			// The proxy delivers to this directory as root: no user
			// outside the owner (and the pod's fsGroup) may write it.
			if fi.Mode()&0o002 != 0 {
				t.Errorf("pod dir mode %v is world-writable; want at most %v", fi.Mode(), GroupPodDirMode)
			}
			if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || st.Gid != tc.wantGID {
				t.Errorf("pod dir owner %d:%d, want 0:%d", st.Uid, st.Gid, tc.wantGID)
			}
			if ri, err := os.Stat(cfg.Root); err != nil || ri.Mode().Perm() != RootMode {
				t.Errorf("root %s: %v, %v; want mode %v", cfg.Root, ri.Mode(), err, RootMode)
			}
			if n := mountCount(t, tgt); n != 1 {
				t.Fatalf("%d mounts at the target, want 1", n)
			}
			// The app creates its socket in the volume; aether-proxy
			// reaches it at <root>/<uid>/<file>.
			app := listenIn(t, tgt, "app.sock")
			dial(t, filepath.Join(dir, "app.sock"))
			if tc.group != "" {
				si, err := os.Lstat(filepath.Join(dir, "app.sock"))
				if err != nil {
					t.Fatal(err)
				}
				if gid := si.Sys().(*syscall.Stat_t).Gid; gid != tc.wantGID {
					t.Errorf("socket group %d, want the mount group %d (setgid dir)", gid, tc.wantGID)
				}
			}
			if p, err := d.Probe(context.Background(), &csipb.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
				t.Errorf("Probe once the root exists = %v, %v; want ready", p, err)
			}

			// While the app still has its socket bound through the
			// target, the mount is busy: Internal, kubelet retries.
			if _, err := d.NodeUnpublishVolume(context.Background(), &csipb.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: tgt}); status.Code(err) != codes.Internal {
				t.Errorf("NodeUnpublishVolume while the app listens: %v, want Internal (busy)", err)
			}
			_ = app.Close()
			unpublish(t, d, tgt)
			if n := mountCount(t, tgt); n != 0 {
				t.Errorf("%d mounts left at the target", n)
			}
			assertGone(t, tgt)
			assertGone(t, dir)
		})
	}
}

func TestPublishIsIdempotent(t *testing.T) {
	d, cfg := mountedDriver(t)
	tgt := target(cfg, testUID, "sock")
	for range 3 {
		publish(t, d, publishReq(tgt, testUID))
	}
	if n := mountCount(t, tgt); n != 1 {
		t.Fatalf("%d mounts at the target after three publishes, want 1", n)
	}
	for _, tc := range []struct {
		name string
		req  *csipb.NodePublishVolumeRequest
	}{
		{"another pod's dir at the same target", publishReq(tgt, "0a1b2c3d-0000-4000-8000-000000000001")},
		{"another mount group at the same target", func() *csipb.NodePublishVolumeRequest {
			r := publishReq(tgt, testUID)
			r.VolumeCapability.GetMount().VolumeMountGroup = "1000"
			return r
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := d.NodePublishVolume(context.Background(), tc.req)
			if status.Code(err) != codes.AlreadyExists {
				t.Fatalf("NodePublishVolume: %v, want AlreadyExists", err)
			}
			if n := mountCount(t, tgt); n != 1 {
				t.Errorf("%d mounts at the target, want 1", n)
			}
		})
	}
	unpublish(t, d, tgt)
	unpublish(t, d, tgt) // again: the target is gone, success
	assertGone(t, filepath.Join(cfg.Root, testUID))
}

func TestTwoTargetsShareThePodDir(t *testing.T) {
	d, cfg := mountedDriver(t)
	t1, t2 := target(cfg, testUID, "a"), target(cfg, testUID, "b")
	publish(t, d, publishReq(t1, testUID))
	publish(t, d, publishReq(t2, testUID))
	dir := filepath.Join(cfg.Root, testUID)
	// The app listens through the second volume; the first one goes.
	app := listenIn(t, t2, "app.sock")
	dial(t, filepath.Join(t1, "app.sock"))

	unpublish(t, d, t1)
	assertGone(t, t1)
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("pod dir removed while %s still uses it: %v", t2, err)
	}
	dial(t, filepath.Join(t2, "app.sock"))
	dial(t, filepath.Join(dir, "app.sock"))

	_ = app.Close()
	unpublish(t, d, t2)
	assertGone(t, t2)
	assertGone(t, dir)
}

func TestUnpublishUnknownTargets(t *testing.T) {
	d, cfg := mountedDriver(t)
	// Never published: success, nothing made.
	unpublish(t, d, target(cfg, testUID, "never"))
	// A target dir left by a publish that failed before mounting: removed.
	left := target(cfg, testUID, "left")
	if err := os.MkdirAll(left, 0o750); err != nil {
		t.Fatal(err)
	}
	unpublish(t, d, left)
	assertGone(t, left)
	// Another pod's dir is untouched by an unrelated unpublish.
	other := "0a1b2c3d-0000-4000-8000-000000000002"
	publish(t, d, publishReq(target(cfg, other, "sock"), other))
	unpublish(t, d, target(cfg, testUID, "never"))
	if _, err := os.Stat(filepath.Join(cfg.Root, other)); err != nil {
		t.Errorf("unrelated unpublish removed pod %s's dir: %v", other, err)
	}
	unpublish(t, d, target(cfg, other, "sock"))
}

func TestPublishNeverFollowsASymlinkOutOfTheRoot(t *testing.T) {
	d, cfg := mountedDriver(t)
	outside := t.TempDir()
	before, err := os.Stat(outside)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(cfg.Root, RootMode); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(cfg.Root, testUID)); err != nil {
		t.Fatal(err)
	}
	tgt := target(cfg, testUID, "sock")
	_, err = d.NodePublishVolume(context.Background(), publishReq(tgt, testUID))
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("NodePublishVolume over a symlinked pod dir: %v, want FailedPrecondition", err)
	}
	if n := mountCount(t, tgt); n != 0 {
		t.Errorf("%d mounts at the target, want none", n)
	}
	if fi, err := os.Stat(outside); err != nil || fi.Mode() != before.Mode() {
		t.Errorf("the symlink's destination changed: %v, %v", fi.Mode(), err)
	}
}

func TestPublishFailuresLeaveNothing(t *testing.T) {
	d, cfg := mountedDriver(t)
	// A file where the target directory belongs: nothing is mounted and the
	// pod dir this publish made is removed again.
	file := target(cfg, testUID, "file")
	if err := os.MkdirAll(filepath.Dir(file), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := d.NodePublishVolume(context.Background(), publishReq(file, testUID)); status.Code(err) != codes.Internal {
		t.Fatalf("NodePublishVolume at a file: %v, want Internal", err)
	}
	assertGone(t, filepath.Join(cfg.Root, testUID))

	// A second volume of the pod asking for another mount group than the
	// dir already has: refused, the first volume is untouched.
	first := target(cfg, testUID, "a")
	publish(t, d, publishReq(first, testUID))
	req := publishReq(target(cfg, testUID, "b"), testUID)
	req.VolumeCapability.GetMount().VolumeMountGroup = "1000"
	if _, err := d.NodePublishVolume(context.Background(), req); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("NodePublishVolume with another group: %v, want FailedPrecondition", err)
	}
	if n := mountCount(t, req.GetTargetPath()); n != 0 {
		t.Errorf("%d mounts at the refused target", n)
	}
	if n := mountCount(t, first); n != 1 {
		t.Errorf("%d mounts at the first target, want 1", n)
	}
	unpublish(t, d, first)
	assertGone(t, filepath.Join(cfg.Root, testUID))
}
