// Package workloadapi serves the SPIFFE Workload API (the X.509 half) from
// the agent's SVID store: FetchX509SVID streams every SVID the node holds,
// each with the trust bundle, and a new message on every change and
// rotation; FetchX509Bundles streams the bundle. The JWT and WIT methods
// answer Unimplemented. The caller is aether-proxy acting for every managed
// pod of its node, not a single workload, so no workload attestation is
// done: the access control is NewGRPCServer's, the socket's SO_PEERCRED uid
// check and the token every call must carry (GRPCOptions.Token), which
// only aether-proxy reads.
//
// No SVIDs: the spec says a server SHOULD answer PermissionDenied to a
// workload entitled to none. go-spiffe's watchers (WatchX509Context,
// X509Source) retry any code but Canceled and InvalidArgument with a linear
// backoff (1 s, 2 s, ... 30 s, reset by every message received), and its
// one-shot FetchX509SVID(s) return the error. So that a proxy that starts on
// an empty node neither backs off to 30 s nor fails, a stream opened while
// the node holds no SVID is held open without a message until the first
// SVID exists. When the last SVID goes (the last managed pod removed), the
// stream ends with PermissionDenied ("no identity issued", as SPIRE's agent
// says): that is the only way to tell a go-spiffe client its SVIDs are
// gone; its watcher reconnects after 1 s and waits again.
package workloadapi

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// HeaderKey and HeaderValue are the metadata every Workload API call must
// carry (the spec's protection against SSRF through a proxying client).
const (
	HeaderKey   = "workload.spiffe.io"
	HeaderValue = "true"
)

// Source is the state the server streams: agent/identity.Store.
type Source interface {
	// Snapshot returns the current SVIDs and a channel closed at the next
	// change (a mint, a rotation or a drop).
	Snapshot() ([]*x509svid.SVID, <-chan struct{})
	// Bundle is the trust bundle of the SVIDs' trust domain.
	Bundle() *x509bundle.Bundle
}

// Server implements the SPIFFE Workload API service. Responses are built
// once per change of the source and shared by every stream; an SVID's
// encoded key is kept while the SVID is held, so a rotation of one SVID
// among many encodes only that one.
type Server struct {
	workloadpb.UnimplementedSpiffeWorkloadAPIServer

	src Source
	log *slog.Logger

	// stopped is closed by Stop: every stream ends with Unavailable.
	stopped  chan struct{}
	stopOnce sync.Once

	mu       sync.Mutex
	builtAt  <-chan struct{}              // the change channel resp was built for
	resp     *workloadpb.X509SVIDResponse // nil: not built yet, or no SVIDs
	entries  map[*x509svid.SVID]*workloadpb.X509SVID
	bundle   []byte             // DER of the bundle's authorities, concatenated
	bundleOf *x509bundle.Bundle // the source's bundle that bundle encodes
}

// New returns a server of src; log may be nil.
func New(src Source, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{src: src, log: log, stopped: make(chan struct{}), entries: map[*x509svid.SVID]*workloadpb.X509SVID{}}
}

// Register registers the service on g.
func (s *Server) Register(g grpc.ServiceRegistrar) { workloadpb.RegisterSpiffeWorkloadAPIServer(g, s) }

// Stop ends every open stream (with Unavailable, which go-spiffe clients
// retry) so a graceful gRPC stop does not wait for clients to leave.
func (s *Server) Stop() { s.stopOnce.Do(func() { close(s.stopped) }) }

// checkHeader refuses a call without the workload.spiffe.io: true metadata.
func checkHeader(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	if !slices.Contains(md.Get(HeaderKey), HeaderValue) {
		return status.Errorf(codes.InvalidArgument, "security header missing from request: set metadata %s: %s", HeaderKey, HeaderValue)
	}
	return nil
}

// FetchX509SVID streams the node's SVIDs: a message now (or as soon as the
// first SVID exists) and one after every change; PermissionDenied when the
// last SVID is dropped.
func (s *Server) FetchX509SVID(_ *workloadpb.X509SVIDRequest, stream grpc.ServerStreamingServer[workloadpb.X509SVIDResponse]) error {
	ctx := stream.Context()
	if err := checkHeader(ctx); err != nil {
		return err
	}
	sent := false
	for {
		resp, changed, err := s.x509Response()
		if err != nil {
			s.log.Error("failed to build x509 svid response", "error", err.Error())
			return status.Errorf(codes.Unavailable, "failed to build the response: %v", err)
		}
		switch {
		case resp != nil:
			if err := stream.Send(resp); err != nil {
				return err
			}
			sent = true
		case sent:
			return status.Error(codes.PermissionDenied, "no identity issued: this node holds no SVID any more (its last managed pod is gone)")
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil
		case <-s.stopped:
			return status.Error(codes.Unavailable, "the agent is shutting down")
		}
	}
}

// FetchX509Bundles streams the trust bundle, which is known even while the
// node holds no SVID (a proxy can verify peers before its pods exist).
func (s *Server) FetchX509Bundles(_ *workloadpb.X509BundlesRequest, stream grpc.ServerStreamingServer[workloadpb.X509BundlesResponse]) error {
	ctx := stream.Context()
	if err := checkHeader(ctx); err != nil {
		return err
	}
	var sent []byte
	for {
		_, changed := s.src.Snapshot()
		td, der := s.bundleDER()
		if !bytes.Equal(der, sent) {
			resp := &workloadpb.X509BundlesResponse{Bundles: map[string][]byte{td.IDString(): der}}
			if err := stream.Send(resp); err != nil {
				return err
			}
			sent = der
		}
		// A CA rotation changes the bundle (agent/identity Store.SetCA):
		// every stream gets the new one.
		select {
		case <-changed:
		case <-ctx.Done():
			return nil
		case <-s.stopped:
			return status.Error(codes.Unavailable, "the agent is shutting down")
		}
	}
}

// FetchJWTSVID is not served: the embedded provider issues X.509-SVIDs only.
func (s *Server) FetchJWTSVID(ctx context.Context, _ *workloadpb.JWTSVIDRequest) (*workloadpb.JWTSVIDResponse, error) {
	if err := checkHeader(ctx); err != nil {
		return nil, err
	}
	return nil, errNoJWT
}

// FetchJWTBundles is not served (X.509 only).
func (s *Server) FetchJWTBundles(_ *workloadpb.JWTBundlesRequest, stream grpc.ServerStreamingServer[workloadpb.JWTBundlesResponse]) error {
	if err := checkHeader(stream.Context()); err != nil {
		return err
	}
	return errNoJWT
}

// ValidateJWTSVID is not served (X.509 only).
func (s *Server) ValidateJWTSVID(ctx context.Context, _ *workloadpb.ValidateJWTSVIDRequest) (*workloadpb.ValidateJWTSVIDResponse, error) {
	if err := checkHeader(ctx); err != nil {
		return nil, err
	}
	return nil, errNoJWT
}

var errNoJWT = status.Error(codes.Unimplemented, "JWT-SVIDs are not issued by aether-agent's embedded provider: it serves X.509-SVIDs only (FetchX509SVID, FetchX509Bundles)")

// bundleDER is the trust domain and the bundle's authorities, DER
// concatenated (the wire form of X509SVID.bundle and
// X509BundlesResponse.bundles).
func (s *Server) bundleDER() (spiffeid.TrustDomain, []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bundleDERLocked()
}

// bundleDERLocked is bundleDER with s.mu held. A new bundle drops the
// encoded SVID entries, which carry it.
func (s *Server) bundleDERLocked() (spiffeid.TrustDomain, []byte) {
	b := s.src.Bundle()
	if b != s.bundleOf {
		s.bundle, s.bundleOf = concatDER(b.X509Authorities()), b
		clear(s.entries)
	}
	return b.TrustDomain(), s.bundle
}

func concatDER(certs []*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, c.Raw...)
	}
	return out
}

// x509Response returns the response for the source's current state (nil
// when it holds no SVID) and the channel closed at its next change. It is
// built once per change and shared by every stream.
func (s *Server) x509Response() (*workloadpb.X509SVIDResponse, <-chan struct{}, error) {
	svids, changed := s.src.Snapshot()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.builtAt == changed {
		return s.resp, changed, nil
	}
	_, bundle := s.bundleDERLocked()
	entries := make(map[*x509svid.SVID]*workloadpb.X509SVID, len(svids))
	var resp *workloadpb.X509SVIDResponse
	if len(svids) > 0 {
		resp = &workloadpb.X509SVIDResponse{Svids: make([]*workloadpb.X509SVID, 0, len(svids))}
	}
	for _, sv := range svids {
		e, ok := s.entries[sv]
		if !ok {
			key, err := x509.MarshalPKCS8PrivateKey(sv.PrivateKey)
			if err != nil {
				return nil, nil, fmt.Errorf("failed to encode the key of SVID %q: %w", sv.ID, err)
			}
			e = &workloadpb.X509SVID{SpiffeId: sv.ID.String(), X509Svid: concatDER(sv.Certificates), X509SvidKey: key, Bundle: bundle}
		}
		entries[sv] = e
		resp.Svids = append(resp.Svids, e)
	}
	s.entries, s.resp, s.builtAt = entries, resp, changed
	return resp, changed, nil
}
