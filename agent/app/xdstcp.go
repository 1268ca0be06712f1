package app

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"

	"aether.io/node/pkg/tlsfiles"
	"aether.io/node/xds/workload"
)

// Limits of workload discovery on --xds-address (TCP). The unix socket is
// closed to everything but root on the node and keeps the larger limits
// a reconnect with initial_resource_versions of a big cluster needs.
const (
	// DefaultXDSMaxRecvBytes bounds one request received on TCP.
	DefaultXDSMaxRecvBytes = 4 << 20
	// xdsTCPMaxStreams bounds the concurrent streams of one TCP connection.
	xdsTCPMaxStreams = 16
	// xdsTCPMaxConns bounds the open TCP connections.
	xdsTCPMaxConns = 256
	// DefaultXDSHandshakeTimeout is the default --xds-handshake-timeout:
	// how long a new connection may take for its TLS handshake and HTTP/2
	// preface. Until then it holds one of the xdsTCPMaxConns slots, so a
	// peer that opens connections and sends nothing must lose them soon.
	DefaultXDSHandshakeTimeout = 3 * time.Second
	// maxXDSHandshakeTimeout is the longest --xds-handshake-timeout.
	maxXDSHandshakeTimeout = time.Minute
	// xdsTCPKeepaliveMin is the shortest client ping interval accepted;
	// a client pinging more often is disconnected (GOAWAY).
	xdsTCPKeepaliveMin = 10 * time.Second
)

// isLoopback reports whether a --xds-address host:port binds only
// loopback: "localhost" or a loopback IP. An empty host binds every
// address.
func isLoopback(hostport string) (bool, error) {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false, err
	}
	if strings.EqualFold(host, "localhost") {
		return true, nil
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback(), nil
}

// checkXDSAddress validates --xds-address against its TLS flags: a partial
// set is an error, and an address beyond loopback needs all three.
func (c *Config) checkXDSAddress() error {
	if c.XDSAddress == "" {
		if !c.XDSTLS.Empty() {
			return fmt.Errorf("invalid --xds-tls-cert/--xds-tls-key/--xds-client-ca: given without --xds-address")
		}
		return nil
	}
	loop, err := isLoopback(c.XDSAddress)
	if err != nil {
		return fmt.Errorf("invalid --xds-address %q: want host:port: %w", c.XDSAddress, err)
	}
	switch {
	case !c.XDSTLS.Empty() && !c.XDSTLS.Complete():
		return fmt.Errorf("invalid --xds-tls-cert %q, --xds-tls-key %q, --xds-client-ca %q: give all three or none", c.XDSTLS.Cert, c.XDSTLS.Key, c.XDSTLS.CA)
	case !loop && c.XDSTLS.Empty():
		return fmt.Errorf("invalid --xds-address %q: beyond loopback workload discovery requires mutual TLS; give --xds-tls-cert, --xds-tls-key and --xds-client-ca (the CA that signs the clients' certificates), or bind 127.0.0.1/[::1]", c.XDSAddress)
	}
	if c.XDSHandshakeTimeout <= 0 || c.XDSHandshakeTimeout > maxXDSHandshakeTimeout {
		return fmt.Errorf("invalid --xds-handshake-timeout %s: must be more than 0 and at most %s", c.XDSHandshakeTimeout, maxXDSHandshakeTimeout)
	}
	if c.XDSMaxRecvBytes <= 0 || c.XDSMaxRecvBytes > 64<<20 {
		return fmt.Errorf("invalid --xds-max-recv-bytes %d: must be 1-%d", c.XDSMaxRecvBytes, 64<<20)
	}
	return nil
}

// tcpServerOptions are the gRPC options of workload discovery on TCP:
// mutual TLS when configured (files reloaded when they change), the
// receive limit, bounded streams, keepalive enforcement and a bounded
// handshake, and a log line naming each verified client.
func tcpServerOptions(c *Config, log *slog.Logger) ([]grpc.ServerOption, error) {
	opts := append(workload.ServerGRPCOptions(c.XDSMaxRecvBytes),
		// Flow-control windows no larger than one request: a connection
		// can buffer no more than that.
		grpc.InitialWindowSize(int32(min(c.XDSMaxRecvBytes, 8<<20))),
		grpc.InitialConnWindowSize(int32(min(c.XDSMaxRecvBytes, 16<<20))),
		grpc.MaxConcurrentStreams(xdsTCPMaxStreams),
		// A connection that has not finished its TLS handshake and HTTP/2
		// preface by then is closed, and its slot of xdsTCPMaxConns
		// (netutil.LimitListener) freed; one that fails earlier frees it at
		// once (gRPC closes it).
		grpc.ConnectionTimeout(c.XDSHandshakeTimeout),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: xdsTCPKeepaliveMin, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			log.Info("workload discovery client", "peer", peerAddr(ss.Context()), "principal", principal(ss.Context()), "method", info.FullMethod)
			return h(srv, ss)
		}),
	)
	if c.XDSTLS.Empty() {
		return opts, nil
	}
	r, err := tlsfiles.NewReloader(c.XDSTLS, log.With("component", "xds_tls"))
	if err != nil {
		return nil, fmt.Errorf("failed to load the TLS files of --xds-address: %w", err)
	}
	return append(opts, grpc.Creds(credentials.NewTLS(r.ServerConfig("h2")))), nil
}

func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// principal names the verified client of a TLS stream: its first URI SAN
// (a SPIFFE ID), else its subject common name; "" without TLS.
func principal(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return ""
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return ""
	}
	return leafName(ti.State.VerifiedChains[0][0])
}

func leafName(c *x509.Certificate) string {
	if len(c.URIs) > 0 {
		return c.URIs[0].String()
	}
	return c.Subject.CommonName
}
