package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/netutil"

	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/types"
	linearcache "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"k8s.io/client-go/dynamic"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"aether.io/node/agent/identity"
	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/agent/policy"
	"aether.io/node/agent/services"
	"aether.io/node/agent/store"
	"aether.io/node/agent/uds"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/lifecycle"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/registry"
	"aether.io/node/xds/listener"
	"aether.io/node/xds/resource"
	"aether.io/node/xds/workload"
)

// listenerSync keeps the per-pod Listener resources the proxy binds in each
// pod's network namespace in step with the stored records: built from a
// record when it becomes durable (and at replay), removed only at RemovePod.
// It implements pods.Observer; updates are O(listeners of one pod).
type listenerSync struct {
	cache *linearcache.LinearCache
	ports listener.Ports
	// udsRoot resolves each pod's UDS socket (--uds-csi-root).
	udsRoot string
	log     *slog.Logger
	// defaultPolicy is --inbound-policy ("" = permissive); invalidPolicy,
	// when set, counts builds of pods with an invalid policy annotation.
	defaultPolicy string
	invalidPolicy prometheus.Counter
	// trustDomain, when set (pods have identities: --ca-cert or
	// --external-identities), puts
	// each pod's SPIFFE ID in its listeners, so the proxy serves HBONE for
	// it.
	trustDomain string

	mu       sync.Mutex
	sent     map[string]string            // container ID -> listenerInput of the published listeners
	prepared map[string]preparedListeners // container ID -> built by Prepare, not published yet
}

// preparedListeners are a pod's listeners built ahead of RecordStored.
type preparedListeners struct {
	in string
	ls []*listenerv3.Listener
}

// maxPrepared bounds the prepared builds kept: one per AddPod in flight,
// left behind only by a write that failed (its pod is not stored).
const maxPrepared = 1024

func newListenerSync(ports listener.Ports, udsRoot string, log *slog.Logger) *listenerSync {
	return &listenerSync{
		cache: linearcache.NewLinearCache(resource.ListenerType), ports: ports, udsRoot: udsRoot, log: log,
		sent: map[string]string{}, prepared: map[string]preparedListeners{},
	}
}

// listenerInput is every record field listener.Build reads (the ports are
// the listenerSync's own), NUL-separated: equal inputs build equal
// listeners, so a record stored again with the same input (a health or
// registration change, a ReportAddResult) publishes nothing and builds
// nothing.
func (l *listenerSync) listenerInput(p *cniv1.CNIPod) string {
	var b strings.Builder
	policy, _ := l.inboundPolicy(p)
	for _, s := range []string{p.GetContainerId(), p.GetNamespace(), p.GetName(), p.GetUid(), p.GetNetworkNamespace(), l.udsSocket(p), policy, l.spiffeID(p)} {
		b.WriteString(s)
		b.WriteByte(0)
	}
	for _, s := range p.GetIps() {
		b.WriteString(s)
		b.WriteByte(0)
	}
	if dp := p.GetDeclaredPorts(); dp != nil {
		b.WriteString("ports")
		for _, port := range dp.GetTcp() {
			b.WriteByte(0)
			b.WriteString(strconv.FormatUint(uint64(port), 10))
		}
	}
	return b.String()
}

// declaredPorts is the record's declared TCP ports for listener.Pod: known
// when the record carries them (an agent that predates them wrote none).
// The API validates each port; one out of range is left out.
func declaredPorts(p *cniv1.CNIPod) (known bool, ports []uint16) {
	dp := p.GetDeclaredPorts()
	if dp == nil {
		return false, nil
	}
	for _, port := range dp.GetTcp() {
		if port >= 1 && port <= 65535 {
			ports = append(ports, uint16(port))
		}
	}
	return true, ports
}

// udsSocket is the pod's resolved UDS socket, or "" (none asked, or
// refused: no or several csi.aether.io volumes, which the pod manager and
// aetherctl report); its inbound then goes over TCP.
func (l *listenerSync) udsSocket(p *cniv1.CNIPod) string {
	sock, _, err := uds.Resolve(l.udsRoot, p)
	if err != nil {
		return ""
	}
	return sock
}

// inboundPolicy is the pod's inbound policy: its annotation, else the
// agent's default; invalid reports an annotation served strict.
func (l *listenerSync) inboundPolicy(p *cniv1.CNIPod) (policy string, invalid bool) {
	def := l.defaultPolicy
	if def == "" {
		def = meshcontract.InboundPolicyPermissive
	}
	return meshcontract.InboundPolicyOf(p.GetAnnotations(), def)
}

// spiffeID is the pod's SPIFFE ID when the agent serves identities, else "".
func (l *listenerSync) spiffeID(p *cniv1.CNIPod) string {
	if l.trustDomain == "" {
		return ""
	}
	a := identity.AccountOf(p.GetNamespace(), p.GetServiceAccount())
	return meshcontract.SPIFFEID(l.trustDomain, a.Namespace, a.ServiceAccount)
}

func (l *listenerSync) build(p *cniv1.CNIPod) ([]*listenerv3.Listener, error) {
	policy, invalid := l.inboundPolicy(p)
	if invalid {
		l.log.Warn("invalid inbound policy annotation; serving the pod strict", "namespace", p.GetNamespace(), "name", p.GetName(),
			"annotation", meshcontract.InboundPolicyAnnotation, "value", p.GetAnnotations()[meshcontract.InboundPolicyAnnotation])
		if l.invalidPolicy != nil {
			l.invalidPolicy.Inc()
		}
	}
	ips := make([]netip.Addr, 0, len(p.GetIps()))
	for _, s := range p.GetIps() {
		if a, err := netip.ParseAddr(s); err == nil {
			ips = append(ips, a)
		}
	}
	known, ports := declaredPorts(p)
	return listener.Build(listener.Pod{
		ContainerID: p.GetContainerId(), Namespace: p.GetNamespace(), Name: p.GetName(), UID: p.GetUid(),
		NetNSPath: p.GetNetworkNamespace(), IPs: ips, Ports: l.ports, UDSSocket: l.udsSocket(p),
		InboundPolicy:      policy,
		SPIFFEID:           l.spiffeID(p),
		DeclaredPortsKnown: known, DeclaredTCPPorts: ports,
	})
}

// Prepare builds the listeners of a record whose write is syncing
// (pods.Preparer), unless they are published already; RecordStored
// publishes them once the record is durable.
func (l *listenerSync) Prepare(rec *store.Record) {
	p := rec.Pod
	in := l.listenerInput(p)
	l.mu.Lock()
	published := l.sent[p.GetContainerId()] == in
	l.mu.Unlock()
	if published {
		return
	}
	ls, err := l.build(p)
	if err != nil {
		return // RecordStored builds again and logs
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.prepared) >= maxPrepared {
		clear(l.prepared)
	}
	l.prepared[p.GetContainerId()] = preparedListeners{in: in, ls: ls}
}

// RecordStored publishes the pod's listeners when their input differs from
// what was published (health changes do not touch listeners): the ones
// Prepare built for this input, or built now.
func (l *listenerSync) RecordStored(rec *store.Record) {
	p := rec.Pod
	in := l.listenerInput(p)
	l.mu.Lock()
	defer l.mu.Unlock()
	pre, ok := l.prepared[p.GetContainerId()]
	delete(l.prepared, p.GetContainerId())
	if prev, ok := l.sent[p.GetContainerId()]; ok && prev == in {
		return
	}
	ls := pre.ls
	if !ok || pre.in != in {
		var err error
		if ls, err = l.build(p); err != nil {
			l.log.Error("failed to build pod listeners", "namespace", p.GetNamespace(), "name", p.GetName(),
				"container_id", p.GetContainerId(), "error", err.Error())
			return
		}
	}
	update := make(map[string]cachev3.Resource, len(ls))
	for _, x := range ls {
		update[x.GetName()] = x
	}
	if err := l.cache.UpdateResources(update, nil); err != nil {
		l.log.Error("failed to publish pod listeners", "container_id", p.GetContainerId(), "error", err.Error())
		return
	}
	l.sent[p.GetContainerId()] = in
}

// RecordRemoved withdraws the pod's listeners (the proxy drains them).
func (l *listenerSync) RecordRemoved(key string) {
	names := make([]string, 0, len(listener.Roles))
	for _, r := range listener.Roles {
		names = append(names, listener.ListenerName(key, r))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.sent, key)
	delete(l.prepared, key)
	if err := l.cache.UpdateResources(nil, names); err != nil {
		l.log.Error("failed to withdraw pod listeners", "container_id", key, "error", err.Error())
	}
}

// localSource is the index source (workload.Index.Writer) of this node's
// own records; the registry follower writes as workload.FollowerSource.
const localSource = "local"

// localWorkloads serves this node's pods in workload discovery from the
// stored records, not from the registry: a terminating pod is deregistered
// at once (no new traffic is routed to it) but stays here, UNHEALTHY, until
// RemovePod, like every local xDS resource. It writes to the index as
// localSource, so the follower of other nodes can neither replace nor
// remove what it serves (and the reverse).
type localWorkloads struct {
	cfg   workload.Config
	idx   *workload.Index
	local *workload.Writer
	log   *slog.Logger
}

func (w *localWorkloads) RecordStored(_ *store.Record, ep registry.Endpoint) {
	wl, err := workload.Build(w.cfg, ep)
	if err != nil {
		w.log.Error("failed to build workload", "container_id", ep.Key, "error", err.Error())
		return
	}
	if _, err := w.local.Upsert(ep.Key, wl); err != nil {
		w.log.Error("failed to index workload", "container_id", ep.Key, "error", err.Error())
	}
}

func (w *localWorkloads) RecordRemoved(key string) { w.local.Remove(key) }

// nodeXDS is the pods.Observer that keeps the node's xDS resources: per-pod
// listeners and, when workload discovery is served, local workloads; with
// identity on, it also keeps the accounts the node's SVIDs are minted for.
type nodeXDS struct {
	listeners *listenerSync
	workloads *localWorkloads // nil when workload discovery is off
	// services is the Service model of the workload index and policies
	// its authorization model (nil when workload discovery is off).
	services *services.Model
	policies *policy.Model
	accounts *podAccounts // nil when identity is off
}

func (n *nodeXDS) RecordStored(rec *store.Record, ep registry.Endpoint) {
	n.listeners.RecordStored(rec)
	if n.workloads != nil {
		n.workloads.RecordStored(rec, ep)
	}
	if n.accounts != nil {
		n.accounts.RecordStored(rec, ep)
	}
}

// Prepare builds the pod's listeners while its record syncs (pods.Preparer).
func (n *nodeXDS) Prepare(rec *store.Record) { n.listeners.Prepare(rec) }

func (n *nodeXDS) RecordRemoved(key string) {
	n.listeners.RecordRemoved(key)
	if n.workloads != nil {
		n.workloads.RecordRemoved(key)
	}
	if n.accounts != nil {
		n.accounts.RecordRemoved(key)
	}
}

func newNodeXDS(c *Config, log *slog.Logger, met services.Metrics) *nodeXDS {
	n := &nodeXDS{listeners: newListenerSync(listener.Ports{}, c.UDSRoot, log.With("component", "lds"))}
	n.listeners.defaultPolicy = c.InboundPolicy
	if c.CA != nil {
		n.accounts = newPodAccounts()
	}
	if c.HBONE() {
		n.listeners.trustDomain = c.TrustDomain
	}
	if c.XDSSocket != "" || c.XDSAddress != "" {
		idx := workload.NewIndex()
		n.workloads = &localWorkloads{
			// With identities (ours or SPIRE's), every managed pod's
			// proxy serves HBONE on its :15008 (host-network pods stay
			// NONE).
			cfg: workload.Config{ClusterID: c.ClusterID, TrustDomain: c.TrustDomain, Network: c.Network, HBONE: c.HBONE()},
			idx: idx, local: idx.Writer(localSource), log: log.With("component", "wds"),
		}
		// The models are the index's Membership before anything is
		// upserted: the policy model answers for both (Services from the
		// Service model) and learns every workload's labels at build.
		n.services = services.New(services.Config{ClusterID: c.ClusterID, ClusterDomain: c.ClusterDomain, Network: c.Network},
			idx, met, log.With("component", "services"))
		n.policies = policy.New(c.RootNamespace, idx, n.services, log.With("component", "policy"))
		n.workloads.cfg.ObserveLabels = n.policies.ObserveLabels
	}
	return n
}

// runServices feeds the Service model from the pod source's origin: the
// manifest directory, or the Kubernetes API (every Service and
// EndpointSlice of the cluster).
func (a *agent) runServices(ctx context.Context) error {
	log := a.log.With("component", "services")
	if a.c.PodManifests != "" {
		return manifests.NewDir(a.c.PodManifests, a.c.ManifestInterval, log, a.nodeRes.services, a.nodeRes.policies).Run(ctx)
	}
	// With the API server away, what the last agent served comes back at
	// once; the informers replace it when they sync.
	a.restoreSnapshot()
	snapDone := make(chan struct{})
	go func() {
		defer close(snapDone)
		_ = a.runSnapshots(ctx)
	}()
	defer func() { <-snapDone }()
	inf, err := services.NewInformers(a.kube, a.nodeRes.services, log)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(a.restConfig)
	if err != nil {
		return fmt.Errorf("failed to build the dynamic kubernetes client: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		policy.RunInformer(ctx, a.kube.Discovery(), dyn, a.nodeRes.policies, 30*time.Second, a.log.With("component", "policy"))
	}()
	inf.Run(ctx)
	<-done
	return nil
}

// remoteOnly hides this node's endpoints from a shared registry, so the
// workload follower serves other nodes' pods while local ones come from the
// records (see localWorkloads).
type remoteOnly struct {
	registry.Registry
	node string
}

func (r remoteOnly) List(ctx context.Context) ([]registry.Endpoint, error) {
	all, err := r.Registry.List(ctx)
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, ep := range all {
		if ep.Node != r.node {
			out = append(out, ep)
		}
	}
	return out, nil
}

func (r remoteOnly) Watch(ctx context.Context) (<-chan registry.Event, error) {
	in, err := r.Registry.Watch(ctx)
	if err != nil {
		return nil, err
	}
	out := make(chan registry.Event)
	go func() {
		defer close(out)
		local := map[string]bool{}
		for ev := range in {
			switch {
			case ev.Type == registry.EventPut && ev.Endpoint.Node == r.node:
				local[ev.Key] = true
				continue
			case ev.Type == registry.EventDelete && local[ev.Key]:
				delete(local, ev.Key)
				continue
			}
			select {
			case out <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// wdsDrain bounds the graceful stop of workload discovery. Its streams are
// ended at once (workload.Server.Stop; clients reconnect with
// initial_resource_versions), so this only bounds responses being sent.
const wdsDrain = 5 * time.Second

// appendXDS adds the agent's discovery endpoints to its lifecycle: workload
// discovery (istio.workload.Workload, delta and SotW, built from the
// registry) and the per-pod listeners for aether-proxy. Every socket follows
// pkg/unixsock.
func (a *agent) appendXDS() {
	c, n, log := a.c, a.nodeRes, a.log
	if n.workloads != nil {
		var srv *workload.Server
		a.lc.Append(lifecycle.Hook{Name: "wds", Start: func(context.Context) error {
			s, err := workload.NewServer(n.workloads.idx, workload.ServerOptions{Logger: log.With("component", "wds"), Registerer: a.metrics.Registry})
			if err != nil {
				return fmt.Errorf("failed to create the workload discovery server: %w", err)
			}
			srv = s
			return nil
		}})
		if c.Registry != "local" {
			// Other nodes' pods come from the shared registry.
			a.lc.Go("wds_follower", func(ctx context.Context) error {
				f := workload.NewFollower(remoteOnly{Registry: a.reg, node: c.NodeName}, n.workloads.cfg, n.workloads.idx,
					log.With("component", "wds_follower"))
				if err := f.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
					return fmt.Errorf("workload discovery stopped following the registry: %w", err)
				}
				return nil
			})
		}
		serve := func(ln net.Listener, opts ...grpc.ServerOption) (net.Listener, lifecycle.Server, error) {
			if opts == nil {
				opts = workload.ServerGRPCOptions(0)
			}
			g := grpc.NewServer(opts...)
			srv.Register(g)
			s := lifecycle.GRPC(g)
			drain := s.Shutdown
			s.Shutdown = func(ctx context.Context) {
				ctx, cancel := context.WithTimeout(ctx, wdsDrain)
				defer cancel()
				srv.Stop()
				drain(ctx)
			}
			log.Info("workload discovery serving", "address", ln.Addr().String())
			return ln, s, nil
		}
		if c.XDSSocket != "" {
			a.lc.Serve("wds_socket", func() (net.Listener, lifecycle.Server, error) {
				ln, err := a.listenSocket("xds-socket", c.XDSSocket)
				if err != nil {
					return nil, lifecycle.Server{}, err
				}
				return serve(ln)
			})
		}
		if c.XDSAddress != "" {
			a.lc.Serve("wds_tcp", func() (net.Listener, lifecycle.Server, error) {
				opts, err := tcpServerOptions(c, log.With("component", "wds_tcp"))
				if err != nil {
					return nil, lifecycle.Server{}, err
				}
				ln, err := net.Listen("tcp", c.XDSAddress)
				if err != nil {
					return nil, lifecycle.Server{}, fmt.Errorf("failed to listen on --xds-address %q: %w", c.XDSAddress, err)
				}
				return serve(netutil.LimitListener(ln, xdsTCPMaxConns), opts...)
			})
		}
	}
	if c.LDSSocket != "" {
		a.lc.Serve("lds_socket", func() (net.Listener, lifecycle.Server, error) {
			ln, err := a.listenSocket("lds-socket", c.LDSSocket)
			if err != nil {
				return nil, lifecycle.Server{}, err
			}
			// The listener streams end when the ADS server's context does.
			ctx, cancel := context.WithCancel(context.Background())
			g := grpc.NewServer()
			discovery.RegisterAggregatedDiscoveryServiceServer(g, serverv3.NewServer(ctx, n.listeners.cache, nil))
			s := lifecycle.GRPC(g)
			drain := s.Shutdown
			s.Shutdown = func(ctx context.Context) {
				cancel()
				drain(ctx)
			}
			log.Info("listener discovery serving", "socket", c.LDSSocket)
			return ln, s, nil
		})
	}
}
