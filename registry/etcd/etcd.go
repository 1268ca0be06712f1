// Package etcd is the registry.Registry backend that spans nodes: every agent
// writes its own node's endpoints to etcd under <prefix><node>/<key>, bound to
// one lease per agent, and watches the whole prefix to learn every node's.
//
// Lease and liveness: the backend runs the lease keepalive itself (started by
// the first Register, stopped by Close). If the lease is lost (etcd was away
// longer than the TTL, or the lease was revoked) the backend grants a new one
// and writes this node's endpoints again. A node that dies stops keeping its
// lease alive and its endpoints disappear when the TTL runs out. Close does
// not revoke the lease, so a restarting agent does not flap its workloads;
// Revoke deletes this node's endpoints at once (node decommission).
//
// Fence: a write the client gave up on (a timeout across a partition) may
// still be applied by etcd later, after writes of the same key that
// followed it. Every write is therefore a transaction guarded by what this
// node last knew of the key (the mod revisions of its endpoint key and of
// its tombstone, see fence), and changes one of them to a new revision:
// a late write finds them changed and does nothing. Deregister deletes the
// endpoint and writes a tombstone, <prefix minus its last '/'>.tombstones/<node>/<key>
// (beside the endpoints, so watchers never see it; with the node's lease),
// which fences off a late Register of a key that was absent; a later
// Register deletes it, and each node sweeps its own tombstones after
// Options.TombstoneTTL. A write that finds the key changed learns the
// current revisions in the same transaction and tries again: this node
// decided it last.
//
// Watch is Get plus a watch from the next revision; it resumes from the last
// revision it delivered after a disconnect, and if that revision was
// compacted it lists again and sends the difference, so no change is lost.
//
// Trust: an endpoint's key and node are those of its etcd key path
// (<prefix><node>/<key>), never the JSON value's; a value that names another
// key or node is ignored, counted (Rejected) and logged at WARN once per etcd
// key. New refuses plaintext connections (an http:// endpoint, or no TLS
// material at all) unless Options.Insecure is set, and always refuses TLS
// material with an http:// endpoint, which the client would silently drop.
package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"aether.io/node/registry"
)

// DefaultPrefix is the key prefix endpoints are stored under.
const DefaultPrefix = "/aether/endpoints/"

// DefaultLeaseTTL is the lease TTL when Options.LeaseTTL is zero.
const DefaultLeaseTTL = 10 * time.Second

// Options configure the etcd registry.
type Options struct {
	// Endpoints are the etcd client URLs (https://10.0.0.1:2379, unix://...).
	Endpoints []string
	// Node is this agent's node name; it owns <Prefix><Node>/. Required.
	Node string
	// Prefix is the key prefix shared by all agents; DefaultPrefix if empty.
	// It must end with "/".
	Prefix string
	// LeaseTTL is how long a dead node's endpoints survive; DefaultLeaseTTL if
	// zero. etcd rounds it up to whole seconds (minimum 2 s).
	LeaseTTL time.Duration
	// DialTimeout bounds the first connection; 5 s if zero.
	DialTimeout time.Duration
	// CertFile and KeyFile are the client certificate; CAFile the trusted CA.
	// All empty for plain connections, which need Insecure.
	CertFile, KeyFile, CAFile string
	// Insecure allows plaintext connections: http:// endpoints, or no TLS
	// material at all. TLS material with an http:// endpoint is refused even
	// then.
	Insecure bool
	// TombstoneTTL is how long a deregistered endpoint's tombstone stays in
	// etcd (see the package doc); DefaultTombstoneTTL if zero.
	TombstoneTTL time.Duration
	// Logger receives lease and watch records; nil discards.
	Logger *slog.Logger
}

// Registry is the etcd backend. It is safe for concurrent use.
type Registry struct {
	cli        *clientv3.Client
	ownsCli    bool
	node       string
	prefix     string
	tombPrefix string // see tombPrefixOf
	ttl        int64
	tombTTL    time.Duration
	log        *slog.Logger

	ctx    context.Context // ends at Close; owns the keepalive loop
	cancel context.CancelFunc

	// grant is the grant lock (a one-slot semaphore, so that waiting for
	// it honours the caller's context): one lease grant runs at a time,
	// without mu. A grant waiting on an unreachable etcd never blocks
	// Deregister, List or the bookkeeping of Register, and a Register that
	// needs the lease while another grant is in flight gives up at its own
	// deadline.
	grant chan struct{}
	mu    sync.Mutex       // never held across a call to etcd
	lease clientv3.LeaseID // 0 = none yet
	// local holds the endpoints a lease re-grant writes again: those whose
	// Register succeeded (or is in flight) and that were not deregistered.
	local map[string]localEntry
	gen   uint64 // last localEntry.gen handed out
	// writing holds a mark per key with a write in flight (Register,
	// Deregister or the re-registration after a lease loss), its channel
	// closed when it ends: writes of one key reach etcd one at a time, so
	// a Put the client keeps retrying across a partition cannot land
	// after the Delete that followed it (see lockKey).
	writing map[string]*writeMark
	// fences holds what this node knows of its keys in etcd (see fence);
	// a key is absent when unknown. Read and written with the key's write
	// mark held.
	fences map[string]fence
	wg     sync.WaitGroup

	rejected atomic.Uint64
	warnMu   sync.Mutex
	warned   map[string]struct{} // etcd keys whose rejection was logged
}

// writeMark is a write of one key in flight (see lockKey).
type writeMark struct {
	done chan struct{} // closed when the write ends
	// cancel ends the context of a put (Register, or the re-registration
	// after a lease loss); nil for a delete or a sweep. Withdraw calls it:
	// the Deregister that follows then sends its fenced delete at once
	// instead of waiting, behind this mark, for a put stalled on a member
	// that etcd cannot reach (a partitioned leader). If etcd applies that
	// put later, its fence fails (the delete and the tombstone changed
	// both revisions) and it does nothing.
	cancel context.CancelFunc
	// withdrawn: Withdraw ended this put. mu is held.
	withdrawn bool
}

// localEntry is one endpoint of this node; gen tells a failed Register
// whether its entry is still the newest, and prev is the last value whose
// Register succeeded, restored when a later Register of the key fails.
type localEntry struct {
	ep   registry.Endpoint
	gen  uint64
	prev *registry.Endpoint
}

var _ registry.Registry = (*Registry)(nil)

// ErrPlaintext is wrapped by the error of New (and CheckTransport) for a
// plaintext connection without Options.Insecure.
var ErrPlaintext = errors.New("plaintext etcd connection refused")

// ErrTLSOverHTTP is wrapped by the error of New (and CheckTransport) for TLS
// material given with an http:// endpoint, which would drop it.
var ErrTLSOverHTTP = errors.New("TLS material given for an http:// etcd endpoint")

// CheckTransport reports whether New would connect to o.Endpoints as o asks:
// an http:// endpoint with any of CertFile, KeyFile or CAFile wraps
// ErrTLSOverHTTP; a plaintext connection (an http:// endpoint, or no TLS
// material) without Insecure wraps ErrPlaintext. Both name the endpoint.
func (o Options) CheckTransport() error {
	hasTLS := o.CertFile != "" || o.KeyFile != "" || o.CAFile != ""
	for _, ep := range o.Endpoints {
		u, err := url.Parse(ep)
		isHTTP := err == nil && strings.EqualFold(u.Scheme, "http")
		switch {
		case isHTTP && hasTLS:
			return fmt.Errorf("%w: endpoint %q would drop TLS (cert %q, key %q, ca %q); use https://", ErrTLSOverHTTP, ep, o.CertFile, o.KeyFile, o.CAFile)
		case isHTTP && !o.Insecure:
			return fmt.Errorf("%w: endpoint %q is http://; use https:// with TLS, or allow plaintext explicitly (insecure)", ErrPlaintext, ep)
		case !hasTLS && !o.Insecure:
			return fmt.Errorf("%w: endpoint %q has no TLS material (cert, key, ca); give it, or allow plaintext explicitly (insecure)", ErrPlaintext, ep)
		}
	}
	return nil
}

func (o *Options) defaults() error {
	if o.Node == "" {
		return errors.New("invalid etcd registry options: node name is empty")
	}
	if strings.Contains(o.Node, "/") {
		return fmt.Errorf("invalid etcd registry options: node name %q contains '/'", o.Node)
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if !strings.HasSuffix(o.Prefix, "/") {
		return fmt.Errorf("invalid etcd registry options: prefix %q must end with '/'", o.Prefix)
	}
	if o.LeaseTTL == 0 {
		o.LeaseTTL = DefaultLeaseTTL
	}
	if o.LeaseTTL < 0 {
		return fmt.Errorf("invalid etcd registry options: lease TTL %s is negative", o.LeaseTTL)
	}
	if o.TombstoneTTL == 0 {
		o.TombstoneTTL = DefaultTombstoneTTL
	}
	if o.TombstoneTTL < 0 {
		return fmt.Errorf("invalid etcd registry options: tombstone TTL %s is negative", o.TombstoneTTL)
	}
	if o.DialTimeout == 0 {
		o.DialTimeout = 5 * time.Second
	}
	return nil
}

// New connects a client to opts.Endpoints (without blocking) and returns the
// registry. Close releases it.
func New(opts Options) (*Registry, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	if len(opts.Endpoints) == 0 {
		return nil, errors.New("invalid etcd registry options: no etcd endpoints; set at least one URL")
	}
	if err := opts.CheckTransport(); err != nil {
		return nil, fmt.Errorf("invalid etcd registry options: %w", err)
	}
	cfg := clientv3.Config{
		Endpoints:   opts.Endpoints,
		DialTimeout: opts.DialTimeout,
		Logger:      zap.NewNop(),
	}
	if opts.CertFile != "" || opts.KeyFile != "" || opts.CAFile != "" {
		tlsInfo := transport.TLSInfo{CertFile: opts.CertFile, KeyFile: opts.KeyFile, TrustedCAFile: opts.CAFile}
		tc, err := tlsInfo.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("failed to load etcd TLS files (cert %q, key %q, ca %q): %w", opts.CertFile, opts.KeyFile, opts.CAFile, err)
		}
		cfg.TLS = tc
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("failed to create etcd client for %q: %w", opts.Endpoints, err)
	}
	r := newRegistry(cli, opts)
	r.ownsCli = true
	return r, nil
}

// NewWithClient returns a registry on an existing client (Endpoints, TLS
// and DialTimeout are ignored). Close does not close cli.
func NewWithClient(cli *clientv3.Client, opts Options) (*Registry, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	return newRegistry(cli, opts), nil
}

func newRegistry(cli *clientv3.Client, opts Options) *Registry {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ttl := int64((opts.LeaseTTL + time.Second - 1) / time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	r := &Registry{
		cli: cli, node: opts.Node, prefix: opts.Prefix, tombPrefix: tombPrefixOf(opts.Prefix), ttl: ttl, tombTTL: opts.TombstoneTTL, log: log,
		ctx: ctx, cancel: cancel, grant: make(chan struct{}, 1), local: make(map[string]localEntry),
		writing: make(map[string]*writeMark), fences: make(map[string]fence), warned: make(map[string]struct{}),
	}
	r.wg.Add(1)
	go r.sweepTombstones()
	return r
}

func (r *Registry) key(epKey string) string { return r.prefix + r.node + "/" + epKey }

// endpointKey returns the endpoint key of an etcd key under the prefix.
func (r *Registry) endpointKey(k string) (string, bool) {
	_, key, ok := r.splitKey(k)
	return key, ok
}

// splitKey splits an etcd key <prefix><node>/<key> into node and endpoint
// key, both non-empty and the key free of '/'.
func (r *Registry) splitKey(k string) (node, key string, ok bool) {
	rest, ok := strings.CutPrefix(k, r.prefix)
	if !ok {
		return "", "", false
	}
	node, key, ok = strings.Cut(rest, "/")
	if !ok || node == "" || key == "" || strings.Contains(key, "/") {
		return "", "", false
	}
	return node, key, true
}

// Rejected returns how many etcd values were ignored because their etcd key
// is not <prefix><node>/<key> or their JSON names another key or node.
func (r *Registry) Rejected() uint64 { return r.rejected.Load() }

// reject counts an ignored value and logs it at WARN once per etcd key.
func (r *Registry) reject(etcdKey, reason string, args ...any) {
	r.rejected.Add(1)
	r.warnMu.Lock()
	_, done := r.warned[etcdKey]
	r.warned[etcdKey] = struct{}{}
	r.warnMu.Unlock()
	if !done {
		r.log.Warn("ignoring etcd endpoint value", append([]any{"etcd_key", etcdKey, "reason", reason}, args...)...)
	}
}

// forget lets the next rejection of a deleted etcd key be logged again, so
// the set of logged keys does not outgrow what etcd holds.
func (r *Registry) forget(etcdKey string) {
	r.warnMu.Lock()
	delete(r.warned, etcdKey)
	r.warnMu.Unlock()
}

// lockKey waits until no other write of key is in flight, or ctx ends,
// and marks one; the returned func ends it. mu is not held.
func (r *Registry) lockKey(ctx context.Context, key string) (unlock func(), err error) {
	_, unlock, err = r.markKey(ctx, key, nil)
	return unlock, err
}

// lockPut is lockKey for a put: it returns the put's context, which
// Withdraw of key cancels (see writeMark), and the mark, whose withdrawn
// tells the put why it failed. The returned func ends the mark and
// releases the context.
func (r *Registry) lockPut(ctx context.Context, key string) (context.Context, *writeMark, func(), error) {
	pctx, cancel := context.WithCancel(ctx)
	m, unlock, err := r.markKey(ctx, key, cancel)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return pctx, m, func() { unlock(); cancel() }, nil
}

// markKey waits until key has no write mark, or ctx ends, and sets one
// with cancel (nil for a write that Withdraw does not end).
func (r *Registry) markKey(ctx context.Context, key string, cancel context.CancelFunc) (*writeMark, func(), error) {
	for {
		r.mu.Lock()
		busy, ok := r.writing[key]
		if !ok {
			m := &writeMark{done: make(chan struct{}), cancel: cancel}
			r.writing[key] = m
			r.mu.Unlock()
			return m, func() {
				r.mu.Lock()
				delete(r.writing, key)
				r.mu.Unlock()
				close(m.done)
			}, nil
		}
		r.mu.Unlock()
		select {
		case <-busy.done:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("failed to write endpoint %q: another write of it is in flight: %w", key, ctx.Err())
		}
	}
}

// wasWithdrawn reports whether Withdraw ended the put of mark m.
func (r *Registry) wasWithdrawn(m *writeMark) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return m.withdrawn
}

// Register writes ep under this node with the node's lease.
func (r *Registry) Register(ctx context.Context, ep registry.Endpoint) error {
	if ep.Key == "" || strings.Contains(ep.Key, "/") {
		return fmt.Errorf("failed to register endpoint %q: the key must be non-empty and free of '/'", ep.Key)
	}
	val, err := json.Marshal(ep)
	if err != nil {
		return fmt.Errorf("failed to encode endpoint %q: %w", ep.Key, err)
	}
	pctx, mark, unlock, err := r.lockPut(ctx, ep.Key)
	if err != nil {
		return err
	}
	defer unlock()
	// The entry goes in before the Put so that a lease lost meanwhile is
	// re-granted with it; a failed Register takes it out again.
	r.mu.Lock()
	r.gen++
	gen := r.gen
	var prev *registry.Endpoint
	if old, ok := r.local[ep.Key]; ok {
		prev = old.prev
	}
	r.local[ep.Key] = localEntry{ep: ep, gen: gen, prev: prev}
	r.mu.Unlock()
	err = r.put(pctx, ep, val, gen)
	r.mu.Lock()
	defer r.mu.Unlock()
	if mark.withdrawn && err != nil {
		err = fmt.Errorf("failed to register endpoint %q: %w", ep.Key, errWithdrawn)
	}
	cur, ok := r.local[ep.Key]
	if !ok || cur.gen != gen {
		return err // deregistered or registered again meanwhile
	}
	switch {
	case mark.withdrawn:
		// Withdrawn after this call took the mark, before it put its
		// entry in: no re-grant may write the key back.
		delete(r.local, ep.Key)
	case err == nil:
		committed := ep
		r.local[ep.Key] = localEntry{ep: ep, gen: gen, prev: &committed}
	case prev != nil:
		r.local[ep.Key] = localEntry{ep: *prev, gen: gen, prev: prev}
	default:
		delete(r.local, ep.Key)
	}
	return err
}

// errWithdrawn is wrapped by the error of a Register whose key was
// withdrawn (or deregistered) before its next attempt.
var errWithdrawn = errors.New("withdrawn while its registration was in flight")

// put writes ep's encoded value val with the node's lease, granting a new
// lease once if etcd no longer has it. Before each attempt it checks that
// the key's local entry is still gen: a key withdrawn meanwhile is not
// written (a lease grant can take long, and the old lease's expiry may
// have deleted the key by then).
func (r *Registry) put(ctx context.Context, ep registry.Endpoint, val []byte, gen uint64) error {
	for attempt := 0; ; attempt++ {
		lease, err := r.ensureLease(ctx)
		if err != nil {
			return err
		}
		r.mu.Lock()
		cur, ok := r.local[ep.Key]
		r.mu.Unlock()
		if !ok || cur.gen != gen {
			return fmt.Errorf("failed to register endpoint %q: %w", ep.Key, errWithdrawn)
		}
		rev, err := r.fencedWrite(ctx, ep.Key, clientv3.OpPut(r.key(ep.Key), string(val), clientv3.WithLease(lease)), clientv3.OpDelete(r.tombKey(ep.Key)))
		if err == nil {
			r.setFence(ep.Key, fence{ep: rev})
			return nil
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && attempt == 0 {
			r.leaseLost(lease)
			continue
		}
		return fmt.Errorf("failed to register endpoint %q in etcd: %w", ep.Key, err)
	}
}

// Withdraw forgets key locally: no lease re-grant writes it back, and a
// put of it in flight (Register, or the re-registration after a lease
// loss) is cancelled, so it makes no further attempt and the Deregister
// that follows need not wait for it (see writeMark). A put already sent
// may still land, before that Deregister's delete (which then deletes it)
// or after it (then its fence fails and it does nothing).
func (r *Registry) Withdraw(key string) {
	r.mu.Lock()
	delete(r.local, key)
	if m := r.writing[key]; m != nil && m.cancel != nil {
		m.withdrawn = true
		m.cancel()
	}
	r.mu.Unlock()
}

// Deregister deletes the endpoint at once. It is withdrawn first, even if
// the delete fails, so no lease re-grant writes it back; a write of the key
// in flight (which etcd may still apply) ends before the delete is sent.
func (r *Registry) Deregister(ctx context.Context, key string) error {
	r.Withdraw(key)
	unlock, err := r.lockKey(ctx, key)
	if err != nil {
		return fmt.Errorf("failed to deregister endpoint %q from etcd: %w", key, err)
	}
	defer unlock()
	if err := r.deleteWithTombstone(ctx, key); err != nil {
		return fmt.Errorf("failed to deregister endpoint %q from etcd: %w", key, err)
	}
	return nil
}

// List returns every node's endpoints.
func (r *Registry) List(ctx context.Context) ([]registry.Endpoint, error) {
	return r.list(ctx, r.prefix)
}

// ListNode returns this node's endpoints only: it reads <prefix><node>/,
// so its cost does not grow with the cluster (liveness uses it).
func (r *Registry) ListNode(ctx context.Context) ([]registry.Endpoint, error) {
	return r.list(ctx, r.prefix+r.node+"/")
}

func (r *Registry) list(ctx context.Context, prefix string) ([]registry.Endpoint, error) {
	resp, err := r.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("failed to list endpoints under %q: %w", prefix, err)
	}
	out := make([]registry.Endpoint, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if ep, ok := r.decode(kv); ok {
			out = append(out, ep)
		}
	}
	return out, nil
}

// decode returns the endpoint stored at kv, its key and node taken from the
// etcd key path. A value at a key outside the layout, or whose JSON names
// another key or node, is rejected: a writer cannot take over another
// endpoint key or node by what it puts in the value.
func (r *Registry) decode(kv *mvccpb.KeyValue) (registry.Endpoint, bool) {
	var ep registry.Endpoint
	k := string(kv.Key)
	node, key, ok := r.splitKey(k)
	if !ok {
		r.reject(k, "etcd key outside the <prefix><node>/<key> layout", "prefix", r.prefix)
		return ep, false
	}
	if err := json.Unmarshal(kv.Value, &ep); err != nil {
		r.log.Warn("skipping undecodable endpoint", "etcd_key", k, "error", err)
		return ep, false
	}
	if (ep.Key != "" && ep.Key != key) || (ep.Node != "" && ep.Node != node) {
		r.reject(k, "value key or node differs from its etcd key",
			"value_key", ep.Key, "value_node", ep.Node, "path_key", key, "path_node", node)
		return registry.Endpoint{}, false
	}
	ep.Key, ep.Node = key, node
	return ep, true
}

// Revoke revokes this node's lease, deleting all its endpoints at once.
func (r *Registry) Revoke(ctx context.Context) error {
	// A grant in flight would install a lease after this.
	if err := r.lockGrant(ctx); err != nil {
		return fmt.Errorf("failed to revoke the lease of node %q: %w", r.node, err)
	}
	defer r.unlockGrant()
	r.mu.Lock()
	lease := r.lease
	r.lease = 0
	r.local = make(map[string]localEntry)
	r.fences = make(map[string]fence) // the revoke deletes keys and tombstones
	r.mu.Unlock()
	if lease == 0 {
		return nil
	}
	if _, err := r.cli.Revoke(ctx, lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("failed to revoke lease %x: %w", int64(lease), err)
	}
	return nil
}

// Close stops the keepalive and closes the client if New created it. The
// lease is left to expire (see the package doc); call Revoke first to
// delete this node's endpoints at once.
func (r *Registry) Close() error {
	r.cancel()
	r.wg.Wait()
	if r.ownsCli {
		return r.cli.Close()
	}
	return nil
}

// lockGrant takes the grant lock, or returns ctx's error if ctx ends first.
func (r *Registry) lockGrant(ctx context.Context) error {
	select {
	case r.grant <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *Registry) unlockGrant() { <-r.grant }

// currentLease returns the node's lease, 0 if there is none.
func (r *Registry) currentLease() clientv3.LeaseID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lease
}

// ensureLease returns the node's lease, granting it and starting its
// keepalive if there is none. Grants run one at a time under the grant lock
// (waited for no longer than ctx allows), never
// under mu (see Registry).
func (r *Registry) ensureLease(ctx context.Context) (clientv3.LeaseID, error) {
	if lease := r.currentLease(); lease != 0 {
		return lease, nil
	}
	if err := r.lockGrant(ctx); err != nil {
		return 0, fmt.Errorf("failed to grant etcd lease (TTL %ds): waiting for the grant in flight: %w", r.ttl, err)
	}
	defer r.unlockGrant()
	if lease := r.currentLease(); lease != 0 {
		return lease, nil // granted while this call waited
	}
	if r.ctx.Err() != nil {
		return 0, errors.New("failed to grant lease: the registry is closed")
	}
	resp, err := r.cli.Grant(ctx, r.ttl)
	if err != nil {
		return 0, fmt.Errorf("failed to grant etcd lease (TTL %ds): %w", r.ttl, err)
	}
	ka, err := r.cli.KeepAlive(r.ctx, resp.ID)
	if err != nil {
		return 0, fmt.Errorf("failed to keep etcd lease %x alive: %w", int64(resp.ID), err)
	}
	r.mu.Lock()
	r.lease = resp.ID
	r.mu.Unlock()
	r.log.Info("granted etcd lease", "lease", int64(resp.ID), "ttl_seconds", r.ttl)
	r.wg.Add(1)
	go r.keepAlive(resp.ID, ka)
	return resp.ID, nil
}

// keepAlive drains the keepalive responses; when the channel closes while
// the registry is open, the lease is gone: grant a new one and write this
// node's endpoints again, retrying with backoff.
func (r *Registry) keepAlive(lease clientv3.LeaseID, ka <-chan *clientv3.LeaseKeepAliveResponse) {
	defer r.wg.Done()
	for range ka {
	}
	if r.ctx.Err() != nil {
		return
	}
	r.log.Warn("etcd lease lost; granting a new one and registering again", "lease", int64(lease))
	r.leaseLost(lease)
	backoff := 200 * time.Millisecond
	for r.ctx.Err() == nil {
		if err := r.reRegister(); err == nil {
			return
		} else {
			r.log.Warn("failed to register again after losing the lease", "error", err, "backoff", backoff)
		}
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (r *Registry) leaseLost(lease clientv3.LeaseID) {
	r.mu.Lock()
	if r.lease == lease {
		r.lease = 0
	}
	r.mu.Unlock()
}

// reRegister grants a lease (which starts a new keepalive loop) and puts
// every local endpoint with it.
func (r *Registry) reRegister() error {
	ctx, cancel := context.WithTimeout(r.ctx, 10*time.Second)
	defer cancel()
	lease, err := r.ensureLease(ctx)
	if err != nil {
		return err
	}
	r.mu.Lock()
	keys := make([]string, 0, len(r.local))
	for k := range r.local {
		keys = append(keys, k)
	}
	r.mu.Unlock()
	for _, k := range keys {
		if err := r.reRegisterKey(ctx, k, lease); err != nil {
			return err
		}
	}
	return nil
}

// reRegisterKey puts key's local endpoint with lease, its write lock held,
// unless it was deregistered meanwhile.
func (r *Registry) reRegisterKey(ctx context.Context, key string, lease clientv3.LeaseID) error {
	pctx, mark, unlock, err := r.lockPut(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	r.mu.Lock()
	e, still := r.local[key]
	r.mu.Unlock()
	if !still {
		return nil
	}
	val, err := json.Marshal(e.ep)
	if err != nil {
		return fmt.Errorf("failed to encode endpoint %q: %w", key, err)
	}
	rev, err := r.fencedWrite(pctx, key, clientv3.OpPut(r.key(key), string(val), clientv3.WithLease(lease)), clientv3.OpDelete(r.tombKey(key)))
	if err != nil {
		if r.wasWithdrawn(mark) {
			return nil // deregistered meanwhile: nothing to write back
		}
		return fmt.Errorf("failed to register endpoint %q again: %w", key, err)
	}
	r.setFence(key, fence{ep: rev})
	return nil
}

// Watch sends every node's endpoints as Puts, then every change, until ctx
// ends. It survives disconnects and compaction (see the package doc).
func (r *Registry) Watch(ctx context.Context) (<-chan registry.Event, error) {
	resp, err := r.cli.Get(ctx, r.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("failed to list endpoints under %q: %w", r.prefix, err)
	}
	out := make(chan registry.Event, 256)
	go r.watch(ctx, resp, out)
	return out, nil
}

type watchState struct {
	r     *Registry
	out   chan<- registry.Event
	known map[string]int64 // etcd key → mod revision delivered
	rev   int64            // last revision delivered
}

func (w *watchState) send(ctx context.Context, ev registry.Event) bool {
	select {
	case w.out <- ev:
		return true
	case <-ctx.Done():
		return false
	}
}

// apply sends a listing as the difference to what was delivered.
func (w *watchState) apply(ctx context.Context, resp *clientv3.GetResponse) bool {
	seen := make(map[string]struct{}, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if w.known[k] == kv.ModRevision {
			seen[k] = struct{}{}
			continue
		}
		ep, ok := w.r.decode(kv)
		if !ok {
			continue // a delivered key whose value is now rejected is deleted below
		}
		seen[k] = struct{}{}
		w.known[k] = kv.ModRevision
		if !w.send(ctx, registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep}) {
			return false
		}
	}
	for k := range w.known {
		if _, ok := seen[k]; ok {
			continue
		}
		delete(w.known, k)
		if key, ok := w.r.endpointKey(k); ok {
			if !w.send(ctx, registry.Event{Type: registry.EventDelete, Key: key}) {
				return false
			}
		}
	}
	w.rev = resp.Header.Revision
	return true
}

func (r *Registry) watch(ctx context.Context, initial *clientv3.GetResponse, out chan registry.Event) {
	defer close(out)
	w := &watchState{r: r, out: out, known: make(map[string]int64)}
	if !w.apply(ctx, initial) {
		return
	}
	r.watchLoop(ctx, w)
}

// watchLoop watches from w.rev+1 until ctx ends, resuming after errors and
// listing again after compaction.
func (r *Registry) watchLoop(ctx context.Context, w *watchState) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		relist := false
		// RequireLeader: a member cut off from its cluster's leader ends
		// the watch (ErrNoLeader) instead of keeping it open and silent;
		// the loop resumes, and the client can reach another member.
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := r.cli.Watch(wctx, r.prefix, clientv3.WithPrefix(), clientv3.WithRev(w.rev+1))
		for wr := range wch {
			if wr.CompactRevision != 0 {
				r.log.Warn("etcd watch revision compacted; listing again", "from_revision", w.rev+1, "compact_revision", wr.CompactRevision)
				relist = true
				break
			}
			if err := wr.Err(); err != nil {
				r.log.Warn("etcd watch failed; resuming", "revision", w.rev+1, "error", err)
				break
			}
			backoff = 100 * time.Millisecond
			for _, ev := range wr.Events {
				k := string(ev.Kv.Key)
				var e registry.Event
				switch ev.Type {
				case mvccpb.PUT:
					ep, ok := r.decode(ev.Kv)
					if !ok {
						// A delivered endpoint overwritten by a rejected value
						// is gone; anything else is skipped.
						if _, was := w.known[k]; !was {
							continue
						}
						delete(w.known, k)
						key, _ := r.endpointKey(k)
						e = registry.Event{Type: registry.EventDelete, Key: key}
						break
					}
					w.known[k] = ev.Kv.ModRevision
					e = registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep}
				case mvccpb.DELETE:
					r.forget(k)
					delete(w.known, k)
					key, ok := r.endpointKey(k)
					if !ok {
						continue
					}
					e = registry.Event{Type: registry.EventDelete, Key: key}
				}
				if !w.send(ctx, e) {
					cancel()
					return
				}
				w.rev = ev.Kv.ModRevision
			}
		}
		cancel()
		if ctx.Err() != nil {
			return
		}
		if relist {
			resp, err := r.cli.Get(ctx, r.prefix, clientv3.WithPrefix())
			if err == nil {
				if !w.apply(ctx, resp) {
					return
				}
				continue
			}
			r.log.Warn("failed to list endpoints after compaction; retrying", "error", err)
			// Keep relisting: watching from a compacted revision cannot work.
			w.rev = 0
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}
