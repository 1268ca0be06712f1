package cniserver

import (
	"context"
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// PeerInfo is the AuthInfo of a unix-socket peer, read with SO_PEERCRED.
type PeerInfo struct {
	credentials.CommonAuthInfo
	// UID and GID are the peer process's credentials at connect time.
	UID, GID uint32
	// PID is the peer process's ID at connect time.
	PID int32
}

// AuthType implements credentials.AuthInfo.
func (PeerInfo) AuthType() string { return "peercred" }

// PeerUID returns the calling peer's uid from ctx.
func PeerUID(ctx context.Context) (uint32, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return 0, false
	}
	pi, ok := p.AuthInfo.(PeerInfo)
	if !ok {
		return 0, false
	}
	return pi.UID, true
}

// ConnPeer reads SO_PEERCRED of a unix connection.
func ConnPeer(c net.Conn) (PeerInfo, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return PeerInfo{}, fmt.Errorf("failed to read peer credentials: %T is not a unix connection", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return PeerInfo{}, fmt.Errorf("failed to read peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return PeerInfo{}, fmt.Errorf("failed to read peer credentials: %w", err)
	}
	if serr != nil {
		return PeerInfo{}, fmt.Errorf("failed to read peer credentials: %w", serr)
	}
	return PeerInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity},
		UID:            cred.Uid, GID: cred.Gid, PID: cred.Pid,
	}, nil
}

type peerCreds struct{}

// PeerCredentials are server transport credentials that do no handshake
// and attach the peer's SO_PEERCRED as AuthInfo. Clients use insecure
// credentials.
func PeerCredentials() credentials.TransportCredentials { return peerCreds{} }

func (peerCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	pi, err := ConnPeer(c)
	if err != nil {
		return nil, nil, err
	}
	return c, pi, nil
}

func (peerCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("peercred credentials are server-side only")
}

func (peerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}
func (peerCreds) Clone() credentials.TransportCredentials { return peerCreds{} }

// OverrideServerName is required by the (deprecated) interface method.
func (peerCreds) OverrideServerName(string) error { return nil }
