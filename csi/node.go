package csi

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/meshcontract"
)

// NodeGetCapabilities reports VOLUME_MOUNT_GROUP: kubelet passes the pod's
// fsGroup as volume_mount_group instead of chown'ing the volume itself.
func (d *Driver) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	return &csipb.NodeGetCapabilitiesResponse{Capabilities: []*csipb.NodeServiceCapability{{
		Type: &csipb.NodeServiceCapability_Rpc{Rpc: &csipb.NodeServiceCapability_RPC{
			Type: csipb.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP,
		}},
	}}}, nil
}

// NodeGetInfo returns the node name as the node id; the driver has no
// volume limit and no topology.
func (d *Driver) NodeGetInfo(context.Context, *csipb.NodeGetInfoRequest) (*csipb.NodeGetInfoResponse, error) {
	return &csipb.NodeGetInfoResponse{NodeId: d.cfg.NodeName}, nil
}

// publication is a validated NodePublishVolume request.
type publication struct {
	volumeID string
	target   string
	uid      string
	// gid is the volume mount group, -1 for none.
	gid int
}

// podDir returns <root>/<uid>.
func (d *Driver) podDir(uid string) string { return meshcontract.PodSocketDir(d.cfg.Root, uid) }

// invalid returns an InvalidArgument status.
func invalid(format string, a ...any) error {
	return status.Errorf(codes.InvalidArgument, format, a...)
}

// validatePublish checks a NodePublishVolume request; every refusal is
// InvalidArgument and says what is allowed.
func (d *Driver) validatePublish(req *csipb.NodePublishVolumeRequest) (publication, error) {
	p := publication{volumeID: req.GetVolumeId(), gid: -1}
	if p.volumeID == "" {
		return p, invalid("volume_id is missing: kubelet sets it for every inline volume")
	}
	target, err := d.validateTarget(req.GetTargetPath())
	if err != nil {
		return p, err
	}
	p.target = target
	vc := req.GetVolumeCapability()
	if vc == nil {
		return p, invalid("volume_capability is missing: a mount capability is required")
	}
	m := vc.GetMount()
	if m == nil {
		return p, invalid("volume_capability must be a mount (a socket directory), not a block device")
	}
	if len(m.GetMountFlags()) > 0 {
		return p, invalid("mount flags %q are not supported: the directory is always bound nosuid,nodev,noexec", m.GetMountFlags())
	}
	switch mode := vc.GetAccessMode().GetMode(); mode {
	case csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	default:
		return p, invalid("access mode %s is not supported: a socket directory is written on one node (SINGLE_NODE_WRITER, SINGLE_NODE_SINGLE_WRITER or SINGLE_NODE_MULTI_WRITER)", mode)
	}
	if g := m.GetVolumeMountGroup(); g != "" {
		gid, err := strconv.ParseUint(g, 10, 31)
		if err != nil {
			return p, invalid("volume_mount_group %q is not a numeric gid (0 to 2147483647)", g)
		}
		p.gid = int(gid)
	}
	if req.GetReadonly() {
		return p, invalid("readonly is not supported: the app creates its socket in the directory; remove readOnly from the volume")
	}
	vctx := req.GetVolumeContext()
	if vctx[ContextEphemeral] != "true" {
		return p, invalid("only inline ephemeral volumes are supported (volume context %s=%q, want \"true\"): declare the volume inline in the pod (csi: {driver: %s}) and set volumeLifecycleModes: [Ephemeral] on the CSIDriver", ContextEphemeral, vctx[ContextEphemeral], meshcontract.CSIDriver)
	}
	uid := vctx[ContextPodUID]
	if uid == "" {
		return p, invalid("volume context %s is missing: set podInfoOnMount: true on the %s CSIDriver", ContextPodUID, meshcontract.CSIDriver)
	}
	if !podUID.MatchString(uid) {
		return p, invalid("pod uid %q is not a pod uid: one path segment of 1 to 64 letters, digits and dashes", uid)
	}
	p.uid = uid
	return p, nil
}

// validateTarget checks that target is a clean absolute path under the
// kubelet directory, also once the symlinks of its nearest existing
// ancestor are resolved.
func (d *Driver) validateTarget(target string) (string, error) {
	if target == "" {
		return "", invalid("target_path is missing: it must be a path under %s", d.cfg.KubeletDir)
	}
	if !within(d.cfg.KubeletDir, target) {
		return "", invalid("target_path %q is not a clean absolute path under the kubelet directory %s", target, d.cfg.KubeletDir)
	}
	kubelet, err := filepath.EvalSymlinks(d.cfg.KubeletDir)
	if err != nil {
		return "", status.Errorf(codes.Internal, "failed to resolve kubelet dir %q: %v", d.cfg.KubeletDir, err)
	}
	// The nearest existing ancestor: MkdirAll creates the rest below it.
	parent := filepath.Dir(target)
	for {
		resolved, err := filepath.EvalSymlinks(parent)
		if err == nil {
			parent = resolved
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || parent == d.cfg.KubeletDir {
			return "", status.Errorf(codes.Internal, "failed to resolve target dir %q: %v", parent, err)
		}
		parent = filepath.Dir(parent)
	}
	if parent != kubelet && !within(kubelet, parent) {
		return "", invalid("target_path %q resolves to %q, outside the kubelet directory %s", target, parent, kubelet)
	}
	return target, nil
}

// within reports whether p is a clean absolute path strictly below dir.
func within(dir, p string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && strings.HasPrefix(p, dir+"/")
}

// NodePublishVolume creates <root>/<uid>/ and bind-mounts it at the target.
// Publishing the same pod's directory at the same target again succeeds; a
// target that already holds something else is AlreadyExists.
func (d *Driver) NodePublishVolume(_ context.Context, req *csipb.NodePublishVolumeRequest) (*csipb.NodePublishVolumeResponse, error) {
	p, err := d.validatePublish(req)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	dir := d.podDir(p.uid)
	mounted, err := d.isMountPoint(p.target)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	if mounted {
		same, err := sameDir(p.target, dir)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "%v", err)
		}
		if !same {
			return nil, status.Errorf(codes.AlreadyExists, "target_path %q already holds another mount than pod %s's socket dir %s; unpublish it first", p.target, p.uid, dir)
		}
		if err := checkGroup(dir, p.gid); err != nil {
			return nil, status.Errorf(codes.AlreadyExists, "target_path %q is published with another volume mount group: %v", p.target, err)
		}
		return &csipb.NodePublishVolumeResponse{}, nil
	}
	created, err := d.ensurePodDir(dir, p.gid)
	if err != nil {
		return nil, err
	}
	err = ensureTarget(p.target)
	if err == nil {
		err = d.mount.Bind(dir, p.target)
	}
	if err != nil {
		if created { // no target uses a dir this call made
			_ = os.Remove(dir)
		}
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	d.log.Info("published", "volume_id", p.volumeID, "pod_uid", p.uid, "target", p.target, "dir", dir)
	return &csipb.NodePublishVolumeResponse{}, nil
}

// ensurePodDir creates <root>/<uid>/ with the documented mode and owner, or
// checks an existing one: it must be a real directory (never a symlink) with
// the same group. created says this call made it.
func (d *Driver) ensurePodDir(dir string, gid int) (created bool, err error) {
	if err := os.MkdirAll(d.cfg.Root, RootMode); err != nil {
		return false, status.Errorf(codes.Internal, "failed to create uds csi root %q: %v", d.cfg.Root, err)
	}
	fi, err := os.Lstat(dir)
	switch {
	case err == nil && !fi.IsDir():
		return false, status.Errorf(codes.FailedPrecondition, "pod socket dir %q is a %s, not a directory; remove it", dir, fi.Mode().Type())
	case err == nil:
		if err := checkGroup(dir, gid); err != nil {
			return false, status.Errorf(codes.FailedPrecondition, "pod socket dir %q is published with another volume mount group: %v", dir, err)
		}
		return false, nil
	case !errors.Is(err, fs.ErrNotExist):
		return false, status.Errorf(codes.Internal, "failed to stat pod socket dir %q: %v", dir, err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return false, status.Errorf(codes.Internal, "failed to create pod socket dir %q: %v", dir, err)
	}
	mode := PodDirMode
	if gid >= 0 {
		mode = GroupPodDirMode
		if err := os.Lchown(dir, 0, gid); err != nil {
			_ = os.Remove(dir)
			return false, status.Errorf(codes.Internal, "failed to give pod socket dir %q to group %d: %v", dir, gid, err)
		}
	}
	if err := os.Chmod(dir, mode); err != nil { // Mkdir is subject to the umask
		_ = os.Remove(dir)
		return false, status.Errorf(codes.Internal, "failed to set mode %v on pod socket dir %q: %v", mode, dir, err)
	}
	return true, nil
}

// ensureTarget creates the target directory when missing; an existing
// target must be a directory.
func ensureTarget(target string) error {
	fi, err := os.Lstat(target)
	if err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("failed to use target %q: it is a %s, not a directory", target, fi.Mode().Type())
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("failed to stat target %q: %w", target, err)
	}
	if err := os.MkdirAll(target, TargetMode); err != nil {
		return fmt.Errorf("failed to create target %q: %w", target, err)
	}
	return nil
}

// NodeUnpublishVolume unmounts the target and removes it, then removes the
// pod's socket dir once no mount under the kubelet dir shows it. A target
// that is missing or not mounted is success (the call is idempotent).
func (d *Driver) NodeUnpublishVolume(_ context.Context, req *csipb.NodeUnpublishVolumeRequest) (*csipb.NodeUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, invalid("volume_id is missing: pass the id the volume was published with")
	}
	target, err := d.validateTarget(req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := os.Lstat(target); errors.Is(err, fs.ErrNotExist) {
		return &csipb.NodeUnpublishVolumeResponse{}, nil // already gone: success
	}
	mounted, err := d.isMountPoint(target)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	var dir string
	if mounted {
		if dir, err = d.podDirOf(target); err != nil {
			return nil, status.Errorf(codes.Internal, "%v", err)
		}
		if err := d.mount.Unmount(target); err != nil {
			return nil, status.Errorf(codes.Internal, "%v (a process still bound to a socket through this target keeps it busy; retry once it exits)", err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "failed to remove target %q: %v", target, err)
	}
	if dir != "" {
		if err := d.removeIfUnused(dir); err != nil {
			return nil, status.Errorf(codes.Internal, "%v", err)
		}
	}
	d.log.Info("unpublished", "volume_id", req.GetVolumeId(), "target", target, "dir", dir)
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}

// isMountPoint reports whether target is a mount point.
func (d *Driver) isMountPoint(target string) (bool, error) {
	mps, err := d.mount.MountPoints()
	if err != nil {
		return false, fmt.Errorf("failed to list mount points: %w", err)
	}
	for _, mp := range mps {
		if mp == target {
			return true, nil
		}
	}
	return false, nil
}

// podDirOf returns the pod socket dir mounted at target, "" when the mount
// is not one of them.
func (d *Driver) podDirOf(target string) (string, error) {
	entries, err := os.ReadDir(d.cfg.Root)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("failed to list uds csi root %q: %w", d.cfg.Root, err)
	}
	for _, e := range entries {
		if !e.IsDir() || !podUID.MatchString(e.Name()) {
			continue
		}
		dir := d.podDir(e.Name())
		if same, err := sameDir(target, dir); err != nil {
			return "", err
		} else if same {
			return dir, nil
		}
	}
	return "", nil
}

// removeIfUnused removes dir (and the sockets in it) unless a mount point
// under the kubelet dir still shows it.
func (d *Driver) removeIfUnused(dir string) error {
	mps, err := d.mount.MountPoints()
	if err != nil {
		return fmt.Errorf("failed to list mount points: %w", err)
	}
	for _, mp := range mps {
		if !within(d.cfg.KubeletDir, mp) {
			continue
		}
		if same, err := sameDir(mp, dir); err != nil {
			return err
		} else if same {
			return nil // another target of the same pod still uses it
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("failed to remove pod socket dir %q: %w", dir, err)
	}
	return nil
}

// sameDir reports whether a and b are the same directory (a bind mount of
// b at a is). A missing path is not the same as anything.
func sameDir(a, b string) (bool, error) {
	fa, err := os.Stat(a)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("failed to stat %q: %w", a, err)
	}
	fb, err := os.Lstat(b)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("failed to stat %q: %w", b, err)
	}
	return os.SameFile(fa, fb), nil
}

// checkGroup checks that dir was made for volume mount group gid (-1: no
// group): a group dir is setgid and owned by the group.
func checkGroup(dir string, gid int) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("failed to stat %q: %w", dir, err)
	}
	have := -1
	if fi.Mode()&fs.ModeSetgid != 0 {
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("failed to read the group of %q: no stat data", dir)
		}
		have = int(st.Gid)
	}
	if have != gid {
		return fmt.Errorf("%q has group %s, the request asks for %s", dir, groupName(have), groupName(gid))
	}
	return nil
}

// groupName renders a volume mount group for messages.
func groupName(gid int) string {
	if gid < 0 {
		return "none"
	}
	return strconv.Itoa(gid)
}
