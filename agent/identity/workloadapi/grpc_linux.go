package workloadapi

import (
	"context"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/cniserver"
	"aether.io/node/pkg/meshcontract"
)

// MinTokenLen is the shortest GRPCOptions.Token accepted (the agent's
// NewToken makes 64 hex digits).
const MinTokenLen = 32

// Reasons a call without the right token is refused (the reason label of
// GRPCOptions.TokenRejected).
const (
	TokenMissing = "missing"
	TokenInvalid = "invalid"
)

// GRPCOptions configure NewGRPCServer.
type GRPCOptions struct {
	// AllowedUIDs are the peer uids (SO_PEERCRED) that may call; empty
	// means root only.
	AllowedUIDs []uint32
	// Token is the secret every call must carry in the metadata
	// meshcontract.WorkloadAPITokenMetadata (at least MinTokenLen bytes).
	// The peer uid alone does not identify aether-proxy: the proxy relays
	// remote clients' bytes as uid 0, so the check must be something
	// relayed bytes never carry (docs/identity.md).
	Token string
	// TokenFile is where aether-proxy reads Token from, named in refusals.
	TokenFile string
	// Rejected counts refused peers; may be nil.
	Rejected prometheus.Counter
	// TokenRejected counts calls refused for their token, by reason
	// (TokenMissing, TokenInvalid); may be nil.
	TokenRejected *prometheus.CounterVec
	// Logger logs refused peers; may be nil.
	Logger *slog.Logger
}

// NewGRPCServer returns a grpc.Server serving s on a unix socket with the
// agent's socket policy: SO_PEERCRED credentials and only AllowedUIDs may
// call, and every call must carry Token (PermissionDenied otherwise, as on
// the CNI socket). It fails when Token is shorter than MinTokenLen.
func NewGRPCServer(s *Server, o GRPCOptions) (*grpc.Server, error) {
	if len(o.Token) < MinTokenLen {
		return nil, fmt.Errorf("invalid workload api token: %d bytes, want at least %d", len(o.Token), MinTokenLen)
	}
	if len(o.AllowedUIDs) == 0 {
		o.AllowedUIDs = []uint32{0}
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	token := []byte(o.Token)
	check := func(ctx context.Context, method string) error {
		uid, ok := cniserver.PeerUID(ctx)
		if !ok || !slices.Contains(o.AllowedUIDs, uid) {
			if o.Rejected != nil {
				o.Rejected.Inc()
			}
			o.Logger.Warn("workload api peer rejected", "method", method, "peer_uid", int64(uid), "peer_known", ok)
			return status.Errorf(codes.PermissionDenied, "peer uid %d may not call %s (allowed uids: %v)", uid, method, o.AllowedUIDs)
		}
		md, _ := metadata.FromIncomingContext(ctx)
		got := md.Get(meshcontract.WorkloadAPITokenMetadata)
		reason := ""
		switch {
		case len(got) == 0:
			reason = TokenMissing
		case len(got) != 1 || subtle.ConstantTimeCompare([]byte(got[0]), token) != 1:
			reason = TokenInvalid
		}
		if reason == "" {
			return nil
		}
		if o.TokenRejected != nil {
			o.TokenRejected.WithLabelValues(reason).Inc()
		}
		o.Logger.Warn("workload api call rejected: token missing or invalid", "reason", reason, "method", method, "peer_uid", int64(uid), "token_file", o.TokenFile)
		if reason == TokenMissing {
			return status.Errorf(codes.PermissionDenied, "workload api token missing from %s: send metadata %s with the contents of %s (aether-agent writes a new token there at every start; aether-proxy reads it)",
				method, meshcontract.WorkloadAPITokenMetadata, o.TokenFile)
		}
		return status.Errorf(codes.PermissionDenied, "workload api token in metadata %s of %s does not match the one in %s (aether-agent writes a new token there at every start; read it again)",
			meshcontract.WorkloadAPITokenMetadata, method, o.TokenFile)
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
	return g, nil
}
