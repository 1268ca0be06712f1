package workloadapi

import (
	"context"
	"log/slog"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/cniserver"
)

// GRPCOptions configure NewGRPCServer.
type GRPCOptions struct {
	// AllowedUIDs are the peer uids (SO_PEERCRED) that may call; empty
	// means root only.
	AllowedUIDs []uint32
	// Rejected counts refused peers; may be nil.
	Rejected prometheus.Counter
	// Logger logs refused peers; may be nil.
	Logger *slog.Logger
}

// NewGRPCServer returns a grpc.Server serving s on a unix socket with the
// agent's socket policy: SO_PEERCRED credentials and only AllowedUIDs may
// call (PermissionDenied otherwise, as on the CNI socket).
func NewGRPCServer(s *Server, o GRPCOptions) *grpc.Server {
	if len(o.AllowedUIDs) == 0 {
		o.AllowedUIDs = []uint32{0}
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	check := func(ctx context.Context, method string) error {
		uid, ok := cniserver.PeerUID(ctx)
		if ok && slices.Contains(o.AllowedUIDs, uid) {
			return nil
		}
		if o.Rejected != nil {
			o.Rejected.Inc()
		}
		o.Logger.Warn("workload api peer rejected", "method", method, "peer_uid", int64(uid), "peer_known", ok)
		return status.Errorf(codes.PermissionDenied, "peer uid %d may not call %s (allowed uids: %v)", uid, method, o.AllowedUIDs)
	}
	g := grpc.NewServer(grpc.Creds(cniserver.PeerCredentials()),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if err := check(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if err := check(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			return h(srv, ss)
		}))
	s.Register(g)
	return g
}
