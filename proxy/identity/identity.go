// Package identity is aether-proxy's client of the SPIFFE Workload API
// (aether-agent's --workload-api-socket, or any server of the spec): it
// watches the X.509-SVIDs of the node's managed pods' identities and the
// trust bundle, and gives them to the data plane through Source.
//
// Contract for the transport (HBONE): on every TLS handshake, ask Source
// for the SVID of the local workload's identity
// (spiffe://<td>/ns/<namespace>/sa/<service account>) and verify the peer
// against Bundle(). Both rotate underneath: read them per handshake, never
// cache them; an established connection is never touched by a rotation.
// The Watcher also implements x509bundle.Source, so go-spiffe's tlsconfig
// helpers can take it directly.
//
// Lifecycle: Run watches until its context ends. It never blocks the
// proxy's start: when the socket is not there yet (the agent starts after
// the proxy), the watch is retried with a doubling backoff (200 ms to 5 s)
// and each failure is logged; until then SVID reports false and Bundle
// returns nil. When the agent ends the SVID stream with PermissionDenied
// (it holds no SVID any more: its last managed pod is gone), the held SVIDs
// are dropped; on any other error (the agent restarting) they are kept
// until they expire, so a restart of the agent does not stop new
// handshakes.
//
// Every call carries the Workload API token (TokenCredentials): aether-
// agent answers only callers that present the token it wrote next to the
// socket, read again at every call so a restarted agent's new token is
// picked up by the reconnect. A PermissionDenied that names the token keeps
// the SVIDs (the retry reads the file again).
package identity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/meshcontract"
)

// Source gives the proxy the SVID of each local workload identity and the
// trust bundle.
type Source interface {
	// SVID is the current, unexpired SVID of identity id, if the node holds
	// one.
	SVID(id spiffeid.ID) (*x509svid.SVID, bool)
	// Bundle is the current trust bundle of the node's trust domain (it
	// rotates); nil until the first one arrives.
	Bundle() *x509bundle.Bundle
}

// Provider is an identity source the proxy runs: the Workload API Watcher
// (this package) or the SPIRE Delegated Identity API client
// (proxy/identity/spire).
type Provider interface {
	Source
	x509bundle.Source
	// Want tells the provider the full set of identities the data plane
	// needs SVIDs of. A provider that learns its identities by itself (the
	// Watcher) ignores it.
	Want(ids []spiffeid.ID)
	// IDs returns the identities whose SVIDs are held.
	IDs() []spiffeid.ID
	// Changed returns a channel closed at the next change of the SVIDs or
	// the bundles.
	Changed() <-chan struct{}
	// Run serves the provider until ctx ends.
	Run(ctx context.Context) error
}

// Backoff bounds of the watch retries.
const (
	retryMin = 200 * time.Millisecond
	retryMax = 5 * time.Second
)

// Watcher watches a Workload API socket and implements Provider through
// its embedded Store. Build it with New; it does no I/O until Run.
type Watcher struct {
	*Store
	addr      string
	tokenFile string
	log       *slog.Logger
}

var _ Provider = (*Watcher)(nil)

// New returns a Watcher of the Workload API on the unix socket at path
// (e.g. /run/aether/proxy/workload.sock) that sends the token in tokenFile
// on every call (TokenCredentials; "" means DefaultTokenFile(path)). now
// is the clock SVID expiry is judged by (time.Now when nil); log may be
// nil.
func New(path, tokenFile string, now func() time.Time, log *slog.Logger) *Watcher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if tokenFile == "" {
		tokenFile = DefaultTokenFile(path)
	}
	return &Watcher{Store: NewStore(now), addr: "unix://" + path, tokenFile: tokenFile, log: log}
}

// Want implements Provider as a no-op: the Workload API server decides
// which SVIDs the node's proxy holds.
func (w *Watcher) Want([]spiffeid.ID) {}

// Run watches the SVIDs and the bundles until ctx ends (then it returns
// nil). It fails only when the server refuses the watch as malformed
// (InvalidArgument), which no retry can fix.
func (w *Watcher) Run(ctx context.Context) error {
	client, err := workloadapi.New(ctx, workloadapi.WithAddr(w.addr),
		workloadapi.WithDialOptions(grpc.WithPerRPCCredentials(TokenCredentials(w.tokenFile)),
			// The connection's own reconnect backoff follows the watch's
			// (gRPC's default grows to 120 s: an agent that came up late
			// would be seen up to two minutes later).
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           grpcbackoff.Config{BaseDelay: retryMin, Multiplier: 2, Jitter: 0.2, MaxDelay: retryMax},
				MinConnectTimeout: 20 * time.Second,
			})),
		workloadapi.WithLogger(debugLogger{w.log}), workloadapi.WithBackoffStrategy(backoffStrategy{}))
	if err != nil {
		return fmt.Errorf("failed to create the workload api client of %q: %w", w.addr, err)
	}
	defer func() { _ = client.Close() }()
	w.log.Info("watching the workload api", "address", w.addr, "token_file", w.tokenFile)
	errs := make(chan error, 2)
	go func() { errs <- client.WatchX509Context(ctx, svidWatcher{w}) }()
	go func() { errs <- client.WatchX509Bundles(ctx, bundleWatcher{w}) }()
	var failed error
	for range 2 {
		if err := <-errs; err != nil && ctx.Err() == nil && failed == nil {
			failed = fmt.Errorf("failed to watch the workload api at %q: %w", w.addr, err)
			_ = client.Close() // ends the other watch
		}
	}
	return failed
}

// svidWatcher receives the X.509 context stream.
type svidWatcher struct{ w *Watcher }

func (s svidWatcher) OnX509ContextUpdate(c *workloadapi.X509Context) {
	m := make(map[spiffeid.ID]*x509svid.SVID, len(c.SVIDs))
	for _, sv := range c.SVIDs {
		m[sv.ID] = sv
	}
	s.w.SetBundles(c.Bundles, true)
	s.w.ReplaceSVIDs(m)
	s.w.log.Debug("svids updated", "count", len(m))
}

func (s svidWatcher) OnX509ContextWatchError(err error) {
	if status.Code(err) == codes.PermissionDenied && strings.Contains(status.Convert(err).Message(), meshcontract.WorkloadAPITokenMetadata) {
		// Refused for the token (read just before the agent wrote a new
		// one): not a statement about the SVIDs; the retry reads it again.
		s.w.log.Warn("workload api refused the token; retrying with the token file read again", "token_file", s.w.tokenFile, "error", err.Error())
		return
	}
	if status.Code(err) == codes.PermissionDenied {
		n := s.w.DropSVIDs()
		s.w.log.Info("workload api issues no identity: svids dropped", "dropped", n, "detail", err.Error())
		return
	}
	if errors.Is(err, context.Canceled) || status.Code(err) == codes.Canceled {
		return
	}
	s.w.log.Warn("workload api svid watch failed; retrying", "address", s.w.addr, "error", err.Error())
}

// bundleWatcher receives the X.509 bundles stream.
type bundleWatcher struct{ w *Watcher }

func (b bundleWatcher) OnX509BundlesUpdate(set *x509bundle.Set) {
	b.w.SetBundles(set, false)
	b.w.log.Debug("trust bundles updated", "count", set.Len())
}

func (b bundleWatcher) OnX509BundlesWatchError(err error) {
	if errors.Is(err, context.Canceled) || status.Code(err) == codes.Canceled {
		return
	}
	b.w.log.Warn("workload api bundle watch failed; retrying", "address", b.w.addr, "error", err.Error())
}

// backoffStrategy doubles from retryMin to retryMax (go-spiffe's default
// grows linearly to 30 s, too slow for a proxy waiting on its node's agent).
type backoffStrategy struct{}

func (backoffStrategy) NewBackoff() workloadapi.Backoff { return &backoff{next: retryMin} }

type backoff struct{ next time.Duration }

func (b *backoff) Next() time.Duration {
	d := b.next
	b.next = min(2*b.next, retryMax)
	return d
}

func (b *backoff) Reset() { b.next = retryMin }

// debugLogger sends go-spiffe's own logs to slog at debug level; the
// watchers above log what matters at info and warn.
type debugLogger struct{ log *slog.Logger }

func (l debugLogger) Debugf(format string, args ...any) { l.logf(format, args...) }
func (l debugLogger) Infof(format string, args ...any)  { l.logf(format, args...) }
func (l debugLogger) Warnf(format string, args ...any)  { l.logf(format, args...) }
func (l debugLogger) Errorf(format string, args ...any) { l.logf(format, args...) }

func (l debugLogger) logf(format string, args ...any) {
	l.log.Debug("go-spiffe workload api client", "detail", fmt.Sprintf(format, args...))
}
