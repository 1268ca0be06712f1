package app

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sort"
	"sync"
	"time"

	"aether.io/node/agent/identity"
	"aether.io/node/agent/identity/workloadapi"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	"aether.io/node/pkg/lifecycle"
	"aether.io/node/registry"
)

// Bounds of the identity loop: at most one sync per minSyncInterval (a CA
// about to expire clamps SVIDs to it, and their rotation points bunch up),
// and failed mints retried from mintRetry doubling to mintRetryMax.
const (
	minSyncInterval = 100 * time.Millisecond
	mintRetry       = time.Second
	mintRetryMax    = time.Minute
)

// podAccounts is the pods.Observer half of identity: it follows the stored
// records (the same signal the xDS resources follow) and keeps the account
// of each, so the identity loop mints an SVID per account of a pod this node
// holds a record of, from replay until RemovePod (terminating pods keep
// theirs while they drain). Its methods never block.
type podAccounts struct {
	mu    sync.Mutex
	byKey map[string]identity.Account
	// kick wakes the identity loop (buffered 1: changes coalesce).
	kick chan struct{}
}

func newPodAccounts() *podAccounts {
	return &podAccounts{byKey: map[string]identity.Account{}, kick: make(chan struct{}, 1)}
}

func (p *podAccounts) RecordStored(rec *store.Record, _ registry.Endpoint) {
	a := identity.AccountOf(rec.Pod.GetNamespace(), rec.Pod.GetServiceAccount())
	key := rec.Pod.GetContainerId()
	p.mu.Lock()
	cur, ok := p.byKey[key]
	p.byKey[key] = a
	p.mu.Unlock()
	if !ok || cur != a {
		p.signal()
	}
}

func (p *podAccounts) RecordRemoved(key string) {
	p.mu.Lock()
	_, ok := p.byKey[key]
	delete(p.byKey, key)
	p.mu.Unlock()
	if ok {
		p.signal()
	}
}

func (p *podAccounts) signal() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// accounts returns the distinct accounts of the records, sorted.
func (p *podAccounts) accounts() []identity.Account {
	p.mu.Lock()
	seen := make(map[identity.Account]bool, len(p.byKey))
	out := make([]identity.Account, 0, len(p.byKey))
	for _, a := range p.byKey {
		if !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	p.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].ServiceAccount < out[j].ServiceAccount
	})
	return out
}

// appendIdentity adds the embedded SPIFFE provider to the lifecycle when
// --ca-cert is given: the identity loop (mint, rotate, drop) and the
// Workload API socket. Without a CA it only logs, once, that identity is
// off.
func (a *agent) appendIdentity() {
	c, log := a.c, a.log.With("component", "identity")
	if a.svids == nil {
		a.lc.Append(lifecycle.Hook{Name: "identity", Start: func(context.Context) error {
			log.Info("identity off: no --ca-cert/--ca-key; the workload api socket is not served")
			return nil
		}})
		return
	}
	a.lc.Go("identity", func(ctx context.Context) error {
		runIdentity(ctx, a.svids, a.nodeRes.accounts, a.metrics, log)
		return nil
	})
	if c.CAReloadInterval > 0 {
		r := &caReloader{c: c, st: a.svids, kick: a.nodeRes.accounts.signal, m: a.metrics, log: log}
		r.last, _ = r.read()
		a.lc.Go("identity_ca_reload", func(ctx context.Context) error {
			r.run(ctx)
			return nil
		})
	}
	a.lc.Serve("workload_api_socket", func() (net.Listener, lifecycle.Server, error) {
		ln, err := a.listenSocket("workload-api-socket", c.WorkloadAPISocket)
		if err != nil {
			return nil, lifecycle.Server{}, err
		}
		// A fresh token at every start, written before anything is served
		// (aether-proxy reads it per call, so it follows a restart).
		tokenFile := WorkloadAPITokenPath(c.WorkloadAPISocket)
		token, err := writeWorkloadAPIToken(tokenFile)
		if err != nil {
			_ = ln.Close()
			return nil, lifecycle.Server{}, err
		}
		srv := workloadapi.New(a.svids, log)
		g, err := workloadapi.NewGRPCServer(srv, workloadapi.GRPCOptions{
			AllowedUIDs: c.AllowedUIDs, Token: token, TokenFile: tokenFile,
			Rejected:      a.metrics.PeerRejected.WithLabelValues(telemetry.SocketWorkloadAPI),
			TokenRejected: a.metrics.WorkloadAPITokenRejected, Logger: log,
		})
		if err != nil {
			_ = ln.Close()
			return nil, lifecycle.Server{}, err
		}
		s := lifecycle.GRPC(g)
		drain := s.Shutdown
		s.Shutdown = func(ctx context.Context) {
			// The streams end only when clients leave: end them first.
			srv.Stop()
			drain(ctx)
		}
		log.Info("workload api serving", "socket", c.WorkloadAPISocket, "token_file", tokenFile, "trust_domain", c.TrustDomain, "svid_ttl", c.SVIDTTL.String())
		return ln, s, nil
	})
}

// runIdentity keeps st in step with the records' accounts until ctx ends:
// it syncs at once, whenever the accounts change and at the store's next
// rotation point; failed mints are retried with a doubling backoff.
func runIdentity(ctx context.Context, st *identity.Store, pa *podAccounts, m *telemetry.Metrics, log *slog.Logger) {
	retry := mintRetry
	for {
		rep, err := st.SyncReport(pa.accounts())
		m.SVIDs.Set(float64(rep.Held))
		m.SVIDRotations.Add(float64(rep.Rotated))
		m.SVIDMintFailures.Add(float64(rep.Failed))
		if rep.Minted+rep.Rotated+rep.Dropped > 0 {
			log.Info("svids synced", "minted", rep.Minted, "rotated", rep.Rotated, "dropped", rep.Dropped, "held", rep.Held)
		}
		var tick <-chan time.Time
		wait := time.Duration(-1) // none: no SVID held and nothing to retry
		if next := st.NextRotation(); !next.IsZero() {
			wait = time.Until(next)
		}
		if err != nil {
			log.Error("failed to mint svids", "failed", rep.Failed, "retry_in", retry.String(), "error", err.Error())
			if wait < 0 || retry < wait {
				wait = retry
			}
			retry = min(2*retry, mintRetryMax)
		} else {
			retry = mintRetry
		}
		var timer *time.Timer
		if wait >= 0 {
			timer = time.NewTimer(max(wait, minSyncInterval))
			tick = timer.C
		}
		select {
		case <-pa.kick:
		case <-tick:
		case <-ctx.Done():
		}
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// caReloader reads --ca-cert, --ca-key and --ca-trust-bundle every
// --ca-reload-interval and applies a change without a restart: a new CA
// re-mints every SVID (the identity loop is kicked), a new bundle is pushed
// to every Workload API stream. Files that fail to parse keep the CA in use
// (logged at ERROR and counted once per change of the files), so a
// half-written Secret update never stops issuance.
type caReloader struct {
	c    *Config
	st   *identity.Store
	kick func()
	m    *telemetry.Metrics
	log  *slog.Logger
	// last is the digest of the files' contents last looked at.
	last [sha256.Size]byte
}

// read digests the files' current contents.
func (r *caReloader) read() ([sha256.Size]byte, error) {
	h := sha256.New()
	for _, f := range []string{r.c.CACertFile, r.c.CAKeyFile, r.c.CATrustBundleFile} {
		if f == "" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			return [sha256.Size]byte{}, fmt.Errorf("failed to read %q: %w", f, err)
		}
		h.Write(b)
		h.Write([]byte{0})
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum, nil
}

func (r *caReloader) run(ctx context.Context) {
	t := time.NewTicker(r.c.CAReloadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.reload(time.Now())
	}
}

// reload applies the files if their contents changed since the last look.
func (r *caReloader) reload(now time.Time) {
	sum, err := r.read()
	if err != nil {
		// A Secret update swaps a symlink; a file briefly missing is
		// retried at the next tick without counting a failure.
		r.log.Warn("ca files not readable; keeping the ca in use", "error", err.Error())
		return
	}
	if sum == r.last {
		return
	}
	r.last = sum
	ca, anchors, err := r.c.readCA(r.c.CA.TrustDomain(), now)
	if err != nil {
		r.m.CAReloadFailures.Inc()
		r.log.Error("failed to reload the ca; keeping the ca in use", "error", err.Error())
		return
	}
	if !r.st.SetCA(ca, anchors) {
		return
	}
	r.m.CAReloads.Inc()
	r.log.Info("ca reloaded", "ca_subject", ca.Subject(), "trust_anchors", len(anchors)+1)
	r.kick()
}
