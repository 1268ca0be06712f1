package cniserver

import (
	"context"
	"errors"
	"net"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"aether.io/node/pkg/peercred"
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

// ConnPeer reads SO_PEERCRED of a unix connection (pkg/peercred).
func ConnPeer(c net.Conn) (PeerInfo, error) {
	cred, err := peercred.Read(c)
	if err != nil {
		return PeerInfo{}, err
	}
	return PeerInfo{
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity},
		UID:            cred.UID, GID: cred.GID, PID: cred.PID,
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
