package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/proto"

	"aether.io/node/api/istio/security"
	"aether.io/node/api/istio/workload"
	"aether.io/node/pkg/authz"
	"aether.io/node/pkg/flowapi"
	"aether.io/node/pkg/lifecycle"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/flowserver"
	"aether.io/node/proxy/handover"
	"aether.io/node/proxy/identity"
	"aether.io/node/proxy/identity/spire"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/adsclient"
	"aether.io/node/xds/listener"
	"aether.io/node/xds/resource"
)

// Config is the proxy's configuration (the flags of cmd/aether-proxy).
type Config struct {
	// XDSTarget is the agent's xDS endpoint as a gRPC target
	// ("unix:///run/aether/proxy/xds.sock", meshcontract.ProxySocketDir).
	XDSTarget string
	// LDSTarget, when set and different from XDSTarget, is a second xDS
	// endpoint the Listener type is subscribed to on its own stream (the
	// Workload type stays on XDSTarget). Empty: both types share one ADS
	// stream to XDSTarget.
	LDSTarget string
	// NodeID identifies this proxy to the agent (the node name).
	NodeID string
	// AdminAddress is where /metrics, /healthz and /debug/pods are served
	// ("127.0.0.1:18090"; "" disables).
	AdminAddress string
	// MetricsAddress, when set, serves /metrics (only) on a second
	// address, such as the node's, for a Prometheus outside the node;
	// /healthz and /debug/pods stay on AdminAddress.
	MetricsAddress string
	// Dataplane tunes the data plane.
	Dataplane dataplane.Config
	// WorkloadAPISocket is the SPIFFE Workload API socket the pods' SVIDs
	// and the trust bundle are watched on (aether-agent's
	// --workload-api-socket); empty turns identity off. Mutually exclusive
	// with SPIREAdminSocket.
	WorkloadAPISocket string
	// WorkloadAPITokenFile is the file of the token every Workload API call
	// carries (aether-agent writes it); "" means workload-api.token next
	// to WorkloadAPISocket.
	WorkloadAPITokenFile string
	// SPIREAdminSocket is a SPIRE agent's admin socket (its
	// admin_socket_path, serving the Delegated Identity API) the pods' SVIDs
	// and the trust bundle are subscribed on instead (proxy/identity/spire);
	// empty leaves identity to WorkloadAPISocket.
	SPIREAdminSocket string
	// AccessLog selects the connections written to the access log (one
	// JSON line per connection at its end, telemetry.AccessLog): off (the
	// zero value), errors or all. The binary's default is errors.
	AccessLog telemetry.AccessLogLevel
	// AccessLogSampleRate keeps each access-log line with this probability
	// (0..1); 0 means 1, every line.
	AccessLogSampleRate float64
	// AccessLogOpens also writes a line when a connection opens (with
	// AccessLog all only).
	AccessLogOpens bool
	// AccessLogOutput is where the access log goes; nil: os.Stdout.
	AccessLogOutput io.Writer
	// FlowsSocket is the unix socket the live connection events are
	// streamed on (proxy/flowserver, pkg/flowapi: `aetherctl flows`);
	// empty serves none. Its directory is the proxy's own
	// (flowapi.DefaultSocketDir), never one the agent serves or a pod
	// reaches.
	FlowsSocket string
	// FlowsAllowedUIDs are the peer uids (SO_PEERCRED) that may follow the
	// flows; empty means uid 0 only.
	FlowsAllowedUIDs []uint32
	// HandoverSocket is the unix socket (root only) a starting proxy takes
	// the running one's listening sockets over (proxy/handover); empty
	// turns the hand-over off: the proxy binds every listener itself.
	HandoverSocket string
	// HandoverTimeout bounds a successor's sync with the agent before it
	// acknowledges a hand-over (0: DefaultHandoverTimeout).
	HandoverTimeout time.Duration
}

// Proxy is aether-proxy. Construct with New, then Run.
type Proxy struct {
	cfg     Config
	log     *slog.Logger
	Metrics *telemetry.Metrics
	Peers   *peers.Index
	// Services is the Service table captured VIP connections are balanced
	// with (from istio.workload.Address resources).
	Services *peers.Services
	// Authz holds the authorization policies (istio.security.Authorization
	// resources) inbound connections are decided by.
	Authz   *authz.Table
	Manager *dataplane.Manager
	// XDS is the ADS client of XDSTarget; LDS is the separate Listener
	// client when LDSTarget is set (else nil).
	XDS *adsclient.Client
	LDS *adsclient.Client
	// Identity holds the SVIDs of the node's workload identities and the
	// trust bundle: the Workload API Watcher or the SPIRE provider; nil when
	// both WorkloadAPISocket and SPIREAdminSocket are empty.
	Identity identity.Provider

	mu        sync.Mutex
	listeners map[string]listener.Spec
	adminAddr chan net.Addr
	// adminLn, metricsLn and flowsLn are the proxy's own listeners (offered
	// to a successor); own are those a predecessor handed over, by name.
	adminLn, metricsLn, flowsLn net.Listener
	own                         map[string]handover.Socket
}

// New builds the proxy; it does no network I/O.
func New(cfg Config, log *slog.Logger) (*Proxy, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.XDSTarget == "" {
		return nil, errors.New("xds target is empty: set it to the agent's socket, e.g. unix://" + meshcontract.ProxySocketDir + "/" + meshcontract.XDSSocketName)
	}
	if cfg.WorkloadAPISocket != "" && cfg.SPIREAdminSocket != "" {
		return nil, fmt.Errorf("workload api socket %q and spire admin socket %q are both set: choose one identity provider", cfg.WorkloadAPISocket, cfg.SPIREAdminSocket)
	}
	if cfg.FlowsSocket != "" {
		switch dir := filepath.Dir(cfg.FlowsSocket); dir {
		case meshcontract.ProxySocketDir, meshcontract.AgentSocketDir:
			return nil, fmt.Errorf("flows socket %q is in the agent's socket dir %q: give it a directory of the proxy's own, e.g. %s", cfg.FlowsSocket, dir, flowapi.DefaultSocket)
		}
	}
	out, rate := cfg.AccessLogOutput, cfg.AccessLogSampleRate
	if out == nil {
		out = os.Stdout
	}
	if rate == 0 {
		rate = 1
	}
	al, err := telemetry.NewAccessLog(out, cfg.AccessLog, rate, cfg.AccessLogOpens)
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		cfg: cfg, log: log, Metrics: telemetry.NewWithAccessLog(al), Peers: peers.NewIndex(), Services: peers.NewServices(), Authz: authz.NewTable(),
		listeners: map[string]listener.Spec{}, adminAddr: make(chan net.Addr, 1), own: map[string]handover.Socket{},
	}
	if p.cfg.HandoverTimeout == 0 {
		p.cfg.HandoverTimeout = DefaultHandoverTimeout
	}
	dp := cfg.Dataplane
	dp.Services = p.Services
	dp.Authorizer = p.Authz
	switch {
	case cfg.WorkloadAPISocket != "":
		p.Identity = identity.New(cfg.WorkloadAPISocket, cfg.WorkloadAPITokenFile, nil, log.With("component", "identity"))
	case cfg.SPIREAdminSocket != "":
		sp := spire.New(cfg.SPIREAdminSocket, nil, log.With("component", "identity"))
		registerSPIREMetrics(p.Metrics.Registry, sp)
		p.Identity = sp
	}
	if p.Identity != nil {
		// The pods' SVIDs turn HBONE on (proxy/hbone in the data plane).
		dp.Certs = p.Identity
	}
	m, err := dataplane.New(dp, p.Peers, p.Metrics, log)
	if err != nil {
		return nil, err
	}
	p.Manager = m
	node := &core.Node{Id: cfg.NodeID, Cluster: "aether-proxy"}
	p.XDS = &adsclient.Client{
		Target: cfg.XDSTarget, Node: node, TypeURLs: []string{resource.ListenerType, resource.AddressType, resource.AuthorizationType}, Handler: p.apply, Log: log,
	}
	if cfg.LDSTarget != "" && cfg.LDSTarget != cfg.XDSTarget {
		p.XDS.TypeURLs = []string{resource.AddressType, resource.AuthorizationType}
		p.LDS = &adsclient.Client{
			Target: cfg.LDSTarget, Node: node, TypeURLs: []string{resource.ListenerType}, Handler: p.apply, Log: log,
		}
	}
	return p, nil
}

// AdminAddr returns the admin server's bound address once it listens.
func (p *Proxy) AdminAddr(ctx context.Context) (net.Addr, error) {
	select {
	case a := <-p.adminAddr:
		p.adminAddr <- a
		return a, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (p *Proxy) apply(typeURL string, updated []*discovery.Resource, removed []string) error {
	switch typeURL {
	case resource.ListenerType:
		return p.applyListeners(updated, removed)
	case resource.WorkloadType:
		var errs []error
		for _, r := range updated {
			w := &workload.Workload{}
			if err := proto.Unmarshal(r.GetResource().GetValue(), w); err != nil {
				errs = append(errs, fmt.Errorf("failed to decode workload %q: %w", r.GetName(), err))
				continue
			}
			p.upsertWorkload(r.GetName(), w)
		}
		for _, n := range removed {
			p.Peers.Remove(n)
			p.Services.RemoveWorkload(n)
		}
		return errors.Join(errs...)
	case resource.AddressType:
		var errs []error
		for _, r := range updated {
			a := &workload.Address{}
			if err := proto.Unmarshal(r.GetResource().GetValue(), a); err != nil {
				errs = append(errs, fmt.Errorf("failed to decode address %q: %w", r.GetName(), err))
				continue
			}
			switch {
			case a.GetWorkload() != nil:
				p.upsertWorkload(r.GetName(), a.GetWorkload())
			case a.GetService() != nil:
				p.Services.UpsertService(a.GetService())
			default:
				errs = append(errs, fmt.Errorf("address %q carries neither a workload nor a service", r.GetName()))
			}
		}
		for _, n := range removed {
			// A name is a workload uid or a Service's <namespace>/<hostname>;
			// removing what a name is not is a no-op.
			p.Peers.Remove(n)
			p.Services.RemoveWorkload(n)
			p.Services.RemoveService(n)
		}
		if p.Authz.Len() > 0 {
			p.reauthorize() // a workload's bindings may have changed
		}
		return errors.Join(errs...)
	case resource.AuthorizationType:
		var errs []error
		for _, r := range updated {
			a := &security.Authorization{}
			if err := proto.Unmarshal(r.GetResource().GetValue(), a); err != nil {
				errs = append(errs, fmt.Errorf("failed to decode authorization %q: %w", r.GetName(), err))
				continue
			}
			if err := p.Authz.Upsert(a); err != nil {
				// The policy it replaces stays: a bad update never opens
				// what the last good one closed.
				errs = append(errs, err)
			}
		}
		for _, n := range removed {
			p.Authz.Remove(n)
		}
		p.reauthorize()
		return errors.Join(errs...)
	default:
		return fmt.Errorf("unexpected type %q: subscribed to %s, %s and %s", typeURL, resource.ListenerType, resource.AddressType, resource.AuthorizationType)
	}
}

// reauthorize decides the established inbound connections again after a
// policy push: those the new policies refuse are closed at once.
func (p *Proxy) reauthorize() {
	if p.Manager == nil {
		return
	}
	if n := p.Manager.Reauthorize(); n > 0 {
		p.log.Info("closed established connections that authorization policy now refuses", "connections", n)
	}
}

// upsertWorkload indexes w (named name when it carries no uid) as a peer and
// as a Service endpoint.
func (p *Proxy) upsertWorkload(name string, w *workload.Workload) {
	if w.GetUid() == "" {
		w.Uid = name
	}
	p.Peers.Upsert(w)
	p.Services.UpsertWorkload(w)
}

// applyListeners updates the listener state; valid listeners apply even
// when others in the same response are rejected (and NACKed).
func (p *Proxy) applyListeners(updated []*discovery.Resource, removed []string) error {
	var errs []error
	p.mu.Lock()
	for _, r := range updated {
		l := &listenerv3.Listener{}
		if err := proto.Unmarshal(r.GetResource().GetValue(), l); err != nil {
			errs = append(errs, fmt.Errorf("failed to decode listener %q: %w", r.GetName(), err))
			continue
		}
		if err := l.ValidateAll(); err != nil {
			errs = append(errs, fmt.Errorf("invalid listener %q: %w", r.GetName(), err))
			continue
		}
		s, err := listener.Parse(l)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		p.listeners[r.GetName()] = s
	}
	for _, n := range removed {
		delete(p.listeners, n)
	}
	specs := make([]listener.Spec, 0, len(p.listeners))
	for _, s := range p.listeners {
		specs = append(specs, s)
	}
	p.mu.Unlock()
	if p.Identity != nil {
		// The provider fetches the SVIDs of exactly these identities
		// (SPIRE subscribes per identity; the agent's Workload API
		// streams all of them anyway).
		p.Identity.Want(wantedIDs(specs, p.log))
	}
	p.Manager.SetListeners(specs)
	return errors.Join(errs...)
}

// wantedIDs are the distinct SPIFFE IDs the listeners name, sorted; an ID
// that does not parse is logged and left out (its pod serves no HBONE).
func wantedIDs(specs []listener.Spec, log *slog.Logger) []spiffeid.ID {
	seen := map[string]bool{}
	var ids []spiffeid.ID
	for _, s := range specs {
		if s.SPIFFEID == "" || seen[s.SPIFFEID] {
			continue
		}
		seen[s.SPIFFEID] = true
		id, err := spiffeid.FromString(s.SPIFFEID)
		if err != nil {
			log.Error("listener names an invalid spiffe id; no svid is fetched for it", "spiffe_id", s.SPIFFEID, "error", err.Error())
			continue
		}
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b spiffeid.ID) int { return strings.Compare(a.String(), b.String()) })
	return ids
}

// Handler is the admin HTTP handler.
func (p *Proxy) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(p.Metrics.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /debug/pods", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(p.Manager.Status())
	})
	return mux
}

// Run serves until ctx ends: the admin server, the flows socket, the data
// plane and the xDS stream(s). The parts start in this order and stop in
// reverse:
//
//	admin server → metrics server → flows socket → open pods (closed at
//	stop) → data plane → identity (Workload API watch or SPIRE
//	subscriptions) → xDS client(s)
//
// so SIGTERM first stops taking xDS updates, then stops the data plane
// loop, closes every open pod (their last events still reach the flows
// subscribers' queues), and stops the admin server last (/healthz answers
// while the pods drain). Every goroutine has returned when Run does;
// a failed start (the admin address in use) stops what started.
func (p *Proxy) Run(ctx context.Context) error {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	sess, err := p.takeOver(ctx)
	if err != nil {
		return err
	}
	defer p.closeOwn()
	lc := lifecycle.New(p.log, 0)
	if p.cfg.AdminAddress != "" {
		lc.Serve("admin", p.listenAdmin)
	}
	if p.cfg.MetricsAddress != "" {
		lc.Serve("metrics", p.listenMetrics)
	}
	if p.cfg.FlowsSocket != "" {
		lc.Serve("flows", p.listenFlows)
	}
	// Stopped after the pods: their connections' last lines are written.
	lc.Append(lifecycle.Hook{Name: "access_log", Stop: func(context.Context) error {
		p.Metrics.FlushAccessLog()
		return nil
	}})
	lc.Append(lifecycle.Hook{Name: "pods", Stop: func(context.Context) error {
		if err := p.Manager.Close(); err != nil {
			p.log.Warn("failed to close pods", "error", err.Error())
		}
		return nil
	}})
	lc.Go("dataplane", p.Manager.Run)
	if p.Identity != nil {
		// Never blocks the start: the watch (or the SPIRE subscriptions)
		// retries until the agent's socket serves.
		lc.Go("identity", p.Identity.Run)
	}
	lc.Go("xds_client", p.XDS.Run)
	if p.LDS != nil {
		lc.Go("lds_client", p.LDS.Run)
	}
	if p.cfg.HandoverSocket != "" {
		lc.Go("handover", func(ctx context.Context) error { return p.handover(ctx, sess, stop) })
	}
	return lc.Run(ctx)
}

// listenAdmin opens the admin address; the server is closed at once at stop.
func (p *Proxy) listenAdmin() (net.Listener, lifecycle.Server, error) {
	ln, err := p.listenOwn("admin", p.cfg.AdminAddress)
	if err != nil {
		return nil, lifecycle.Server{}, fmt.Errorf("failed to listen on admin address %q: %w", p.cfg.AdminAddress, err)
	}
	p.mu.Lock()
	p.adminLn = ln
	p.mu.Unlock()
	p.adminAddr <- ln.Addr()
	srv := &http.Server{Handler: p.Handler(), ReadHeaderTimeout: 5 * time.Second}
	return ln, lifecycle.Server{Serve: srv.Serve, Shutdown: func(context.Context) { _ = srv.Close() }}, nil
}

// listenMetrics opens the metrics address: /metrics alone, so a scraper
// reaching the node's address sees neither /healthz nor /debug/pods (which
// lists every pod's listeners).
func (p *Proxy) listenMetrics() (net.Listener, lifecycle.Server, error) {
	ln, err := p.listenOwn("metrics", p.cfg.MetricsAddress)
	if err != nil {
		return nil, lifecycle.Server{}, fmt.Errorf("failed to listen on metrics address %q: %w", p.cfg.MetricsAddress, err)
	}
	p.mu.Lock()
	p.metricsLn = ln
	p.mu.Unlock()
	p.log.Info("metrics listening", "addr", ln.Addr().String())
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(p.Metrics.Registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	return ln, lifecycle.Server{Serve: srv.Serve, Shutdown: func(context.Context) { _ = srv.Close() }}, nil
}

// listenFlows opens the flows socket; its clients are closed at once at
// stop.
func (p *Proxy) listenFlows() (net.Listener, lifecycle.Server, error) {
	ln := p.inheritedOwn("flows", p.cfg.FlowsSocket)
	if ln == nil {
		ul, err := flowserver.Listen(p.cfg.FlowsSocket)
		if err != nil {
			return nil, lifecycle.Server{}, err
		}
		ln = ul
	}
	p.mu.Lock()
	p.flowsLn = ln
	p.mu.Unlock()
	srv := flowserver.New(p.Metrics.Flows(), flowserver.Options{AllowedUIDs: p.cfg.FlowsAllowedUIDs, Logger: p.log.With("component", "flows")})
	p.log.Info("flows socket listening", "path", p.cfg.FlowsSocket)
	return ln, lifecycle.Server{Serve: srv.Serve, Shutdown: func(context.Context) { srv.Close() }}, nil
}

// registerSPIREMetrics exports the SPIRE provider's counters.
func registerSPIREMetrics(reg *prometheus.Registry, sp *spire.Provider) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "aether_proxy_identity_svids",
			Help: "SVIDs held by the SPIRE identity provider (expired ones included).",
		}, func() float64 { return float64(sp.Stats().SVIDs) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "aether_proxy_identity_wanted",
			Help: "Identities the SPIRE identity provider is subscribed to.",
		}, func() float64 { return float64(sp.Stats().Wanted) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "aether_proxy_identity_subscription_errors_total",
			Help: "Failed or ended SPIRE Delegated Identity API streams (SVIDs and bundles).",
		}, func() float64 { return float64(sp.Stats().SubscriptionErrors) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "aether_proxy_identity_unsubscribable_total",
			Help: "Wanted identities without an ns/<ns>/sa/<sa> path, which the SPIRE provider cannot subscribe.",
		}, func() float64 { return float64(sp.Stats().Unsubscribable) }),
	)
}
