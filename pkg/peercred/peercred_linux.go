package peercred

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// Cred is a peer process's credentials, as the kernel recorded them when
// it connected.
type Cred struct {
	// UID and GID are the peer's user and group.
	UID, GID uint32
	// PID is the peer's process ID.
	PID int32
}

// Read reads SO_PEERCRED of a unix connection.
func Read(c net.Conn) (Cred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return Cred{}, fmt.Errorf("failed to read peer credentials: %T is not a unix connection", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("failed to read peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("failed to read peer credentials: %w", err)
	}
	if serr != nil {
		return Cred{}, fmt.Errorf("failed to read peer credentials: %w", serr)
	}
	return Cred{UID: cred.Uid, GID: cred.Gid, PID: cred.Pid}, nil
}
