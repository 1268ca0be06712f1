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
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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
