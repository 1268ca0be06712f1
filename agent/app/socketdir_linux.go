package app

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/meshcontract"
)

// tokenTempPrefix starts the name of the temporary file the Workload API
// token is written to before its rename (workloadapi_token_linux.go); a
// leftover of a crash is one of the agent's own files.
const tokenTempPrefix = "." + meshcontract.WorkloadAPITokenFile + ".tmp"

// ownNames are the file names the agent itself keeps in a socket directory
// of c: the base names of every configured socket, the defaults' names and
// the Workload API token (with its temporary file's prefix).
func (c *Config) ownNames() []string {
	names := []string{
		meshcontract.CNISocketName, meshcontract.AdminSocketName, meshcontract.XDSSocketName,
		meshcontract.LDSSocketName, meshcontract.WorkloadAPISocketName, meshcontract.WorkloadAPITokenFile,
	}
	for _, p := range []string{c.CNISocket, c.AdminSocket, c.XDSSocket, c.LDSSocket, c.WorkloadAPISocket} {
		if p != "" {
			names = append(names, filepath.Base(p))
		}
	}
	return names
}

// isOwnName reports whether name is one of own or a token temporary file.
func isOwnName(own []string, name string) bool {
	return slices.Contains(own, name) || strings.HasPrefix(name, tokenTempPrefix)
}

// tightenSocketDir makes an existing socket directory dir 0700 when
// kubelet (hostPath DirectoryOrCreate, for the proxy's mount of
// ProxySocketDir) or an older agent created it open to group or others,
// and only when that is safe: dir is a real directory (not a symlink),
// owned by the agent's own uid (0 in a cluster), and holds nothing but the
// agent's own files (own). It returns changed when it chmod'ed dir; a
// missing dir, or one already closed to group and others, is left as is.
// Any other directory is left untouched with reason saying why, and the
// socket policy (pkg/unixsock) then refuses it.
//
// The directory is opened once (O_NOFOLLOW) and checked and chmod'ed
// through that descriptor, so it cannot be swapped between the check and
// the chmod. It is never removed and created again: aether-proxy's bind
// mount of it would keep pointing at the removed directory and never see
// the agent's sockets again.
func tightenSocketDir(dir string, own []string) (changed bool, from os.FileMode, reason string, err error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return false, 0, "", nil // unixsock creates it 0700
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
		// O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR.
		if fi, lerr := os.Lstat(dir); lerr == nil && fi.Mode()&os.ModeSymlink != 0 {
			return false, 0, "it is a symlink", nil
		}
		return false, 0, "it is not a directory", nil
	case err != nil:
		return false, 0, "", fmt.Errorf("failed to open socket dir %q: %w", dir, err)
	}
	f := os.NewFile(uintptr(fd), dir)
	defer func() { _ = f.Close() }()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, 0, "", fmt.Errorf("failed to stat socket dir %q: %w", dir, err)
	}
	from = os.FileMode(st.Mode & 0o777)
	if from&0o077 == 0 {
		return false, from, "", nil
	}
	if uid := uint32(os.Geteuid()); st.Uid != uid {
		return false, from, fmt.Sprintf("it is owned by uid %d, not the agent's uid %d", st.Uid, uid), nil
	}
	names, err := f.Readdirnames(-1)
	if err != nil {
		return false, from, "", fmt.Errorf("failed to list socket dir %q: %w", dir, err)
	}
	for _, n := range names {
		if !isOwnName(own, n) {
			return false, from, fmt.Sprintf("it holds %q, which is not one of the agent's files", n), nil
		}
	}
	if err := unix.Fchmod(fd, 0o700); err != nil {
		return false, from, "", fmt.Errorf("failed to chmod socket dir %q to 0700: %w", dir, err)
	}
	return true, from, "", nil
}

// prepareSocketDir tightens the directory of the socket of --flag at path
// (tightenSocketDir) and logs a change at info. It returns why an open
// directory was not tightened ("" when it was, or needed not be).
func (c *Config) prepareSocketDir(flag, path string, log *slog.Logger) (string, error) {
	dir := filepath.Dir(path)
	changed, from, reason, err := tightenSocketDir(dir, c.ownNames())
	if err != nil {
		return "", fmt.Errorf("failed to serve --%s %q: %w", flag, path, err)
	}
	if changed {
		log.Info("tightened socket dir mode", "flag", flag, "dir", dir, "from", fmt.Sprintf("%04o", from), "to", "0700")
	}
	return reason, nil
}

// warnSharedSocketDirs logs, at warn, every private socket (CNI, admin)
// configured in the same directory as a socket aether-proxy consumes: the
// proxy mounts that directory, so it could reach the private socket.
func (c *Config) warnSharedSocketDirs(log *slog.Logger) {
	proxyDirs := map[string]string{}
	for flag, p := range map[string]string{"xds-socket": c.XDSSocket, "lds-socket": c.LDSSocket, "workload-api-socket": c.WorkloadAPISocket} {
		if p != "" {
			proxyDirs[filepath.Dir(p)] = flag
		}
	}
	for flag, p := range map[string]string{"cni-socket": c.CNISocket, "admin-socket": c.AdminSocket} {
		if p == "" {
			continue
		}
		if other, ok := proxyDirs[filepath.Dir(p)]; ok {
			log.Warn("private socket shares a directory with a proxy socket; aether-proxy's mount of that directory exposes it",
				"flag", flag, "path", p, "shared_with", other, "fix", "keep --cni-socket and --admin-socket in "+SocketDir+" and the proxy's sockets in "+ProxySocketDir)
		}
	}
}
