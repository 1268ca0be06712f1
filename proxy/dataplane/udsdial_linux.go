package dataplane

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/meshcontract"
)

// ErrUnsafeSocket wraps every refusal of a pod's UDS socket: the path is
// not <uds-csi-root>/<the pod's uid>/<file>, or what is there is not a
// socket the pod's intended user made (a link, another file type, a second
// link count, another owner). The proxy then delivers over TCP.
var ErrUnsafeSocket = errors.New("unsafe pod socket")

// resolveFlags walk a pod-writable tree: no symlink (a pod could point one
// at the agent's sockets), no magic link, no mount crossing, nothing outside
// the starting directory.
const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// dialPodSocket connects to the app's unix socket sock of the pod with uid,
// whose socket directory is meshcontract.PodSocketDir(root, uid). The pod
// can write that directory, so nothing in it is followed: the directory and
// the socket are opened with openat2 (resolveFlags) as O_PATH descriptors,
// checked with fstat (a directory; a socket with one link whose owner
// matches the directory, meshcontract.SocketOwnerMatches), and the connect
// goes to the checked inode through /proc/self/fd, so no rename between the
// check and the connect can redirect it.
func dialPodSocket(ctx context.Context, root, uid, sock string) (net.Conn, error) {
	dirFD, file, err := openPodSocketDir(root, uid, sock)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dirFD)
	var dst unix.Stat_t
	if err := unix.Fstat(dirFD, &dst); err != nil {
		return nil, fmt.Errorf("failed to stat pod socket dir of %q: %w", sock, err)
	}
	sockFD, err := unix.Openat2(dirFD, file, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return nil, refusal(sock, err)
	}
	defer unix.Close(sockFD)
	var st unix.Stat_t
	if err := unix.Fstat(sockFD, &st); err != nil {
		return nil, fmt.Errorf("failed to stat pod socket %q: %w", sock, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFSOCK:
		return nil, fmt.Errorf("%w %q: it is a %s, not a unix socket", ErrUnsafeSocket, sock, fileType(st.Mode))
	case st.Nlink != 1:
		return nil, fmt.Errorf("%w %q: it has %d links; a socket the app bound has one", ErrUnsafeSocket, sock, st.Nlink)
	case !meshcontract.SocketOwnerMatches(unixMode(dst.Mode), dst.Uid, dst.Gid, st.Uid, st.Gid):
		return nil, fmt.Errorf("%w %q: owned by %d:%d, but its directory (%d:%d, %v) lets only uid %d or, if set-group-ID, gid %d create it (docs/csi.md)",
			ErrUnsafeSocket, sock, st.Uid, st.Gid, dst.Uid, dst.Gid, unixMode(dst.Mode), dst.Uid, dst.Gid)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", "/proc/self/fd/"+strconv.Itoa(sockFD))
	if err != nil {
		return nil, fmt.Errorf("failed to connect to pod socket %q: %w", sock, err)
	}
	return c, nil
}

// openPodSocketDir checks that sock is <root>/<uid>/<file> with uid and
// file single path segments, and opens the pod's socket directory below
// root without following links. It returns the directory's O_PATH
// descriptor and file.
func openPodSocketDir(root, uid, sock string) (int, string, error) {
	if root == "" || !filepath.IsAbs(root) {
		return -1, "", fmt.Errorf("%w %q: the proxy's --%s %q is not an absolute path", ErrUnsafeSocket, sock, meshcontract.UDSCSIRootFlag, root)
	}
	if !singleSegment(uid) {
		return -1, "", fmt.Errorf("%w %q: the pod's uid %q is not a single path segment (an agent that sends no uid cannot name a socket dir)", ErrUnsafeSocket, sock, uid)
	}
	dir := meshcontract.PodSocketDir(root, uid)
	file, ok := strings.CutPrefix(sock, dir+"/")
	if !ok || !singleSegment(file) {
		return -1, "", fmt.Errorf("%w %q: not a file directly in the pod's socket dir %q", ErrUnsafeSocket, sock, dir)
	}
	rootFD, err := unix.Open(filepath.Clean(root), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, "", fmt.Errorf("failed to open --%s %q: %w", meshcontract.UDSCSIRootFlag, root, err)
	}
	defer unix.Close(rootFD)
	dirFD, err := unix.Openat2(rootFD, uid, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: resolveFlags})
	if err != nil {
		return -1, "", refusal(sock, err)
	}
	return dirFD, file, nil
}

// refusal explains an openat2 error on the pod's path.
func refusal(sock string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%w %q: the path holds a symbolic link, which the proxy never follows: %w", ErrUnsafeSocket, sock, err)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%w %q: the path leaves the pod's socket dir or crosses a mount: %w", ErrUnsafeSocket, sock, err)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%w %q: the pod's socket dir is not a directory: %w", ErrUnsafeSocket, sock, err)
	case errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("failed to open pod socket %q: this kernel has no openat2 (Linux 5.6+), which UDS delivery needs: %w", sock, err)
	}
	return fmt.Errorf("failed to open pod socket %q: %w", sock, err)
}

// singleSegment reports whether s is one clean path segment.
func singleSegment(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00")
}

// unixMode converts a stat mode's permission, set-group-ID and sticky bits
// to an fs.FileMode.
func unixMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	if m&unix.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

// fileType names a stat mode's file type for an error.
func fileType(m uint32) string {
	switch m & unix.S_IFMT {
	case unix.S_IFLNK:
		return "symbolic link"
	case unix.S_IFREG:
		return "regular file"
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFCHR, unix.S_IFBLK:
		return "device"
	}
	return "file of type " + strconv.FormatUint(uint64(m&unix.S_IFMT), 8)
}
