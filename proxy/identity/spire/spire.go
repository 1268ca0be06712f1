// Package spire is aether-proxy's second identity provider: a client of a
// SPIRE agent's Delegated Identity API (the agent's admin socket,
// admin_socket_path). The proxy is an authorized delegate of the agent and
// subscribes, on behalf of the pods of its node, to the X.509-SVIDs of each
// identity the data plane wants and, once, to the trust bundles.
//
// Selector convention: an identity spiffe://<td>/ns/<ns>/sa/<sa> is
// subscribed with the selectors k8s:ns:<ns> and k8s:sa:<sa>; SPIRE returns
// the SVIDs of every registration entry whose selectors are a subset of
// those, and the provider keeps the one whose SPIFFE ID is the wanted one.
// The SPIRE registration entries must therefore carry exactly (or a subset
// of) those two selectors. Identities of another shape cannot be
// subscribed: Want logs and counts them.
//
// Lifecycle: New does no I/O; Run subscribes until its context ends. Want
// may be called at any time (before Run too) with the full wanted set: new
// identities are subscribed, identities no longer wanted are unsubscribed
// and their SVIDs dropped. A failed stream (the agent restarting, the
// socket not there yet) is retried with a doubling backoff (200 ms to 5 s)
// and the SVIDs received are kept until they expire, like the Workload API
// Watcher's. An empty SVID list from the agent (no entry matches any more)
// drops that identity's SVID.
package spire

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	delegatedv1 "github.com/spiffe/spire-api-sdk/proto/spire/api/agent/delegatedidentity/v1"
	"github.com/spiffe/spire-api-sdk/proto/spire/api/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"aether.io/node/proxy/identity"
)

// Backoff bounds of the subscription retries.
const (
	retryMin = 200 * time.Millisecond
	retryMax = 5 * time.Second
)

// SelectorType is the selector type of the Kubernetes workload attestor,
// the one the registration entries carry.
const SelectorType = "k8s"

// Stats are the provider's counters, for the proxy telemetry.
type Stats struct {
	// SVIDs is the number of SVIDs held (expired ones included).
	SVIDs int
	// Wanted is the number of identities subscribed.
	Wanted int
	// SubscriptionErrors counts failed or ended SVID and bundle streams.
	SubscriptionErrors uint64
	// Unsubscribable counts wanted identities whose SPIFFE ID has no
	// ns/<ns>/sa/<sa> path.
	Unsubscribable uint64
}

// Provider is a Delegated Identity API client; it implements
// identity.Provider through its embedded identity.Store. Build it with New.
type Provider struct {
	*identity.Store
	target string
	log    *slog.Logger

	subErrors      atomic.Uint64
	unsubscribable atomic.Uint64

	mu     sync.Mutex // guards wanted; taken before the Store's lock
	wanted map[spiffeid.ID]struct{}
	wake   chan struct{} // buffered(1): the wanted set changed
}

// New returns a Provider of the SPIRE agent admin socket at path (e.g.
// /run/spire/admin/admin.sock). now is the clock SVID expiry is judged by
// (time.Now when nil); log may be nil.
func New(path string, now func() time.Time, log *slog.Logger) *Provider {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Provider{
		Store:  identity.NewStore(now),
		target: "unix://" + path, log: log,
		wanted: map[spiffeid.ID]struct{}{}, wake: make(chan struct{}, 1),
	}
}

// Selectors returns the SPIRE selectors the provider subscribes id with:
// k8s:ns:<ns> and k8s:sa:<sa> for a path /ns/<ns>/sa/<sa>.
func Selectors(id spiffeid.ID) ([]*types.Selector, error) {
	parts := strings.Split(strings.TrimPrefix(id.Path(), "/"), "/")
	if len(parts) != 4 || parts[0] != "ns" || parts[2] != "sa" || parts[1] == "" || parts[3] == "" {
		return nil, fmt.Errorf("failed to derive selectors of %q: the path is not /ns/<namespace>/sa/<service account>", id.String())
	}
	return []*types.Selector{
		{Type: SelectorType, Value: "ns:" + parts[1]},
		{Type: SelectorType, Value: "sa:" + parts[3]},
	}, nil
}

// Want sets the identities the data plane needs SVIDs of (the full set,
// not a delta). It never blocks.
func (p *Provider) Want(ids []spiffeid.ID) {
	next := make(map[spiffeid.ID]struct{}, len(ids))
	for _, id := range ids {
		if _, err := Selectors(id); err != nil {
			p.unsubscribable.Add(1)
			p.log.Warn("identity cannot be subscribed", "spiffe_id", id.String(), "error", err.Error())
			continue
		}
		next[id] = struct{}{}
	}
	p.mu.Lock()
	p.wanted = next
	for _, id := range p.IDs() {
		if _, ok := next[id]; !ok {
			p.DeleteSVID(id)
		}
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Stats returns the provider's counters.
func (p *Provider) Stats() Stats {
	p.mu.Lock()
	wanted := len(p.wanted)
	p.mu.Unlock()
	return Stats{
		SVIDs: len(p.IDs()), Wanted: wanted,
		SubscriptionErrors: p.subErrors.Load(), Unsubscribable: p.unsubscribable.Load(),
	}
}

// Run subscribes to the bundles and to the SVIDs of the wanted identities
// until ctx ends (then it returns nil, after every stream ended).
func (p *Provider) Run(ctx context.Context) error {
	conn, err := grpc.NewClient(p.target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("failed to create the delegated identity client of %q: %w", p.target, err)
	}
	defer func() { _ = conn.Close() }()
	client := delegatedv1.NewDelegatedIdentityClient(conn)
	p.log.Info("subscribing to the spire agent delegated identity api", "address", p.target)

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { p.retry(ctx, "bundles", func() error { return p.watchBundles(ctx, client) }) })

	subs := map[spiffeid.ID]context.CancelFunc{}
	defer func() {
		for _, cancel := range subs {
			cancel()
		}
	}()
	for {
		p.mu.Lock()
		wanted := make(map[spiffeid.ID]struct{}, len(p.wanted))
		for id := range p.wanted {
			wanted[id] = struct{}{}
		}
		p.mu.Unlock()
		for id, cancel := range subs {
			if _, ok := wanted[id]; !ok {
				cancel()
				delete(subs, id)
				p.log.Info("svid subscription dropped", "spiffe_id", id.String())
			}
		}
		for id := range wanted {
			if _, ok := subs[id]; ok {
				continue
			}
			sctx, cancel := context.WithCancel(ctx)
			subs[id] = cancel
			p.log.Info("svid subscription started", "spiffe_id", id.String())
			wg.Go(func() { p.retry(sctx, "svids", func() error { return p.watchSVIDs(sctx, client, id) }) })
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.wake:
		}
	}
}

// retry runs watch until ctx ends, waiting a doubling backoff after each
// failure (reset when a stream delivered at least once is the caller's
// concern: a stream that ends is always a failure here).
func (p *Provider) retry(ctx context.Context, what string, watch func() error) {
	wait := retryMin
	for {
		err := watch()
		if ctx.Err() != nil {
			return
		}
		p.subErrors.Add(1)
		if errors.Is(err, errDelivered) {
			wait = retryMin
		}
		p.log.Warn("spire delegated identity stream failed; retrying", "stream", what, "address", p.target, "retry_in", wait.String(), "error", fmt.Sprint(err))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, retryMax)
	}
}

// errDelivered marks a stream failure after at least one message: the
// backoff restarts from its minimum.
var errDelivered = errors.New("the stream had delivered")

// watchBundles runs one bundle stream until it fails.
func (p *Provider) watchBundles(ctx context.Context, client delegatedv1.DelegatedIdentityClient) error {
	stream, err := client.SubscribeToX509Bundles(ctx, &delegatedv1.SubscribeToX509BundlesRequest{})
	if err != nil {
		return fmt.Errorf("failed to subscribe to the x509 bundles of %q: %w", p.target, err)
	}
	delivered := false
	for {
		resp, err := stream.Recv()
		if err != nil {
			return wrapDelivered(delivered, fmt.Errorf("failed to receive the x509 bundles of %q: %w", p.target, err))
		}
		set, err := parseBundles(resp.GetCaCertificates())
		if err != nil {
			p.subErrors.Add(1)
			p.log.Error("spire agent sent an unusable bundle; kept the previous one", "error", err.Error())
			continue
		}
		delivered = true
		p.SetBundles(set, false)
		p.log.Debug("trust bundles updated", "count", set.Len())
	}
}

// watchSVIDs runs one SVID stream of id until it fails.
func (p *Provider) watchSVIDs(ctx context.Context, client delegatedv1.DelegatedIdentityClient, id spiffeid.ID) error {
	sel, err := Selectors(id)
	if err != nil {
		return err
	}
	stream, err := client.SubscribeToX509SVIDs(ctx, &delegatedv1.SubscribeToX509SVIDsRequest{Selectors: sel})
	if err != nil {
		return fmt.Errorf("failed to subscribe to the x509 svids of %q: %w", id.String(), err)
	}
	delivered := false
	for {
		resp, err := stream.Recv()
		if err != nil {
			if status.Code(err) == codes.PermissionDenied {
				// The agent does not (or no longer) treat the proxy as a delegate.
				p.DeleteSVID(id)
			}
			return wrapDelivered(delivered, fmt.Errorf("failed to receive the x509 svids of %q: %w", id.String(), err))
		}
		delivered = true
		sv, err := pick(resp.GetX509Svids(), id)
		if err != nil {
			p.subErrors.Add(1)
			p.log.Error("spire agent sent an unusable svid; kept the previous one", "spiffe_id", id.String(), "error", err.Error())
			continue
		}
		if sv == nil {
			p.DeleteSVID(id)
			p.log.Info("spire agent issues no svid for the identity: dropped", "spiffe_id", id.String())
			continue
		}
		p.mu.Lock()
		if _, ok := p.wanted[id]; ok {
			p.PutSVID(sv)
		}
		p.mu.Unlock()
		p.log.Debug("svid updated", "spiffe_id", id.String(), "not_after", sv.Certificates[0].NotAfter)
	}
}

func wrapDelivered(delivered bool, err error) error {
	if delivered {
		return fmt.Errorf("%w: %w", errDelivered, err)
	}
	return err
}

// pick parses the SVID of id among those the agent sent (several entries
// may match the selectors); nil when none is for id.
func pick(svids []*delegatedv1.X509SVIDWithKey, id spiffeid.ID) (*x509svid.SVID, error) {
	for _, s := range svids {
		pid := s.GetX509Svid().GetId()
		if pid.GetTrustDomain() != id.TrustDomain().Name() || pid.GetPath() != id.Path() {
			continue
		}
		var chain []byte
		for _, der := range s.GetX509Svid().GetCertChain() {
			chain = append(chain, der...)
		}
		sv, err := x509svid.ParseRaw(chain, s.GetX509SvidKey())
		if err != nil {
			return nil, fmt.Errorf("failed to parse the x509 svid %q: %w", id.String(), err)
		}
		return sv, nil
	}
	return nil, nil
}

// parseBundles turns the agent's trust domain → concatenated DER CA
// certificates map into a bundle set.
func parseBundles(cas map[string][]byte) (*x509bundle.Set, error) {
	set := x509bundle.NewSet()
	for name, der := range cas {
		td, err := spiffeid.TrustDomainFromString(name)
		if err != nil {
			return nil, fmt.Errorf("failed to parse the trust domain %q: %w", name, err)
		}
		certs, err := x509.ParseCertificates(der)
		if err != nil {
			return nil, fmt.Errorf("failed to parse the bundle of trust domain %q: %w", name, err)
		}
		set.Add(x509bundle.FromX509Authorities(td, certs))
	}
	return set, nil
}
