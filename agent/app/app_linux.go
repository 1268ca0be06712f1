package app

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	adminhandler "aether.io/node/agent/adminapi/handler"
	"aether.io/node/agent/cniserver"
	"aether.io/node/agent/identity"
	"aether.io/node/agent/nodegate"
	"aether.io/node/agent/pods"
	"aether.io/node/agent/podsource"
	"aether.io/node/agent/podsource/kube"
	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/enrolment"
	"aether.io/node/pkg/lifecycle"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	kubereg "aether.io/node/registry/kube"
	"aether.io/node/registry/local"
)

// NewLogger returns a JSON slog logger at level on w.
func NewLogger(w *os.File, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("invalid --log-level %q: want debug, info, warn or error", level)
	}
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l})), nil
}

// Run runs the agent until ctx ends, then shuts down gracefully. The parts
// start in this order and stop in reverse (agent/README.md, "Lifecycle"):
//
//	tracing → store → registry → pods (pod source client, replay) →
//	health HTTP → workload discovery → listener discovery →
//	identity (SVID loop, Workload API socket) →
//	pod source, sync, liveness → CNI socket → node gate → admin socket →
//	readiness
//
// so SIGTERM first fails /readyz, stops accepting admin and CNI calls
// (in-flight RPCs drain), stops the pod source and the loops, stops xDS
// serving, closes the registry and last closes the store: every goroutine
// has returned before the store closes. A part that fails to start stops
// every part started before it.
func Run(ctx context.Context, c *Config, log *slog.Logger) error {
	gcPercent := applyGCPercent(c.GCPercent)
	self, _ := os.ReadFile("/proc/self/cgroup")
	log.Info("go runtime memory settings", "gc_percent", gcPercent, "memory_limit_bytes", applyMemoryLimit("/sys/fs/cgroup", self))
	c.warnSharedSocketDirs(log)
	err := newAgent(c, log).lc.Run(ctx)
	log.Info("stopped")
	return err
}

// agent holds the parts start hooks create for later hooks; it is built
// with no I/O.
type agent struct {
	c       *Config
	log     *slog.Logger
	metrics *telemetry.Metrics
	lc      *lifecycle.Lifecycle
	ready   atomic.Bool
	// synced is closed once the pod source has synced and the agent is
	// ready (awaitSync); the node gate waits for it.
	synced chan struct{}

	tracer        trace.Tracer
	stopTracing   func()
	st            *store.Store
	reg           registry.Registry
	closeRegistry func()
	src           podsource.Source
	kube          kubernetes.Interface
	restConfig    *rest.Config
	nodeRes       *nodeXDS
	mgr           *pods.Manager
	// svids is the embedded SPIFFE provider's store; nil when identity is
	// off (no --ca-cert).
	svids *identity.Store
	// localityUnknown is set when the Node could not be read at start:
	// awaitSync reads it again once the pod source has synced.
	localityUnknown bool
}

func newAgent(c *Config, log *slog.Logger) *agent {
	a := &agent{c: c, log: log, metrics: telemetry.NewMetrics(), lc: lifecycle.New(log, c.ShutdownTimeout), synced: make(chan struct{})}
	a.nodeRes = newNodeXDS(c, log, a.metrics.Services())
	a.nodeRes.listeners.invalidPolicy = a.metrics.InboundPolicyInvalid
	if c.CA != nil {
		a.svids = identity.NewStore(c.CA, c.SVIDTTL, time.Now)
		a.svids.SetCA(c.CA, c.CAAnchors)
	}
	a.lc.Append(lifecycle.Hook{Name: "tracing", Start: a.startTracing, Stop: func(context.Context) error {
		a.stopTracing()
		return nil
	}})
	a.lc.Append(lifecycle.Hook{Name: "store", Start: a.openStore, Stop: func(context.Context) error {
		if err := a.st.Close(); err != nil {
			log.Error("failed to close store", "error", err.Error())
		}
		return nil
	}})
	a.lc.Append(lifecycle.Hook{Name: "registry", Start: a.openRegistry, Stop: func(context.Context) error {
		a.closeRegistry()
		return nil
	}})
	a.lc.Append(lifecycle.Hook{Name: "pods", Start: a.startPods})
	a.lc.Serve("http", a.listenHTTP)
	if c.MetricsAddr != "" {
		a.lc.Serve("metrics", a.listenMetrics)
	}
	a.appendXDS()
	a.appendIdentity()
	a.lc.Go("pod_source", func(ctx context.Context) error { return a.src.Run(ctx, a.mgr.Handler(ctx)) })
	if a.nodeRes.services != nil {
		a.lc.Go("services", a.runServices)
	}
	a.lc.Go("pod_source_sync", a.awaitSync)
	a.lc.Go("liveness", func(ctx context.Context) error {
		a.mgr.RunLiveness(ctx, c.LivenessInterval)
		return nil
	})
	a.lc.Serve("cni_socket", a.listenCNI)
	if c.PodManifests == "" && c.RemoveNotReadyTaint {
		// After cni_socket: the taint goes only once AddPod is answered.
		a.lc.Go("node_gate", func(ctx context.Context) error {
			return nodegate.New(a.kube, c.NodeName, log.With("component", "node_gate")).RunAfter(ctx, a.synced)
		})
	}
	if c.AdminSocket != "" {
		a.lc.Serve("admin_socket", a.listenAdmin)
	}
	// Stops first: /readyz fails before anything else shuts down.
	a.lc.Append(lifecycle.Hook{Name: "readiness", Stop: func(context.Context) error {
		a.ready.Store(false)
		log.Info("shutting down")
		return nil
	}})
	return a
}

func (a *agent) startTracing(ctx context.Context) error {
	tracer, shutdown, err := newTracer(ctx, a.c.OTLPEndpoint, a.c.NodeName)
	if err != nil {
		return err
	}
	a.tracer, a.stopTracing = tracer, shutdown
	return nil
}

func (a *agent) openStore(context.Context) error {
	st, err := store.Open(a.c.StateDir, store.Options{
		Logger:       a.log.With("component", "store"),
		OnQuarantine: func(string, error) { a.metrics.Quarantined.Inc() },
	})
	if err != nil {
		return err
	}
	a.st = st
	return nil
}

func (a *agent) openRegistry(context.Context) error {
	if a.c.Registry == "kube" {
		if err := a.kubeClient(); err != nil {
			return err
		}
	}
	reg, closeReg, err := newRegistry(a.c, a.kube, a.log, a.metrics.Registry)
	if err != nil {
		return err
	}
	a.reg, a.closeRegistry = reg, closeReg
	return nil
}

// startPods builds the pod source and the manager, then replays the store:
// nothing is served before every stored pod is back.
func (a *agent) startPods(ctx context.Context) error {
	c, log := a.c, a.log
	locality := c.Locality
	if c.PodManifests != "" {
		a.src = manifests.New(c.PodManifests, c.NodeName, c.ManifestInterval, log.With("component", "pod_manifests"))
	} else {
		if err := a.kubeClient(); err != nil {
			return err
		}
		a.src = kube.New(a.kube, c.NodeName, 0, log.With("component", "pod_source"))
		if locality == (registry.Locality{}) {
			if l, err := a.nodeLocality(ctx); err == nil {
				locality = l
			} else {
				// The records keep the locality they were stored with
				// (served meanwhile); awaitSync reads the Node again.
				a.localityUnknown = true
				log.Warn("node locality unknown; serving the one stored with each pod record", "node", c.NodeName, "error", err.Error())
			}
		}
	}
	a.mgr = pods.New(pods.Config{
		Node: c.NodeName, Locality: locality, LocalityUnknown: a.localityUnknown, Enrolment: enrolment.Rules{SystemNamespaces: c.SystemNamespaces, AmbientAlias: c.AmbientNamespaces},
		UDSRoot: c.UDSRoot, PodWait: c.PodWait, Observer: a.nodeRes,
	}, a.st, livenessView(a.reg, c.LivenessInterval), a.src, nil, a.metrics, log.With("component", "pods"))
	_, err := a.mgr.Replay(ctx)
	return err
}

// kubeClient builds the agent's one Kubernetes client (for the pod source,
// the kube registry and node gating) unless it exists.
func (a *agent) kubeClient() error {
	if a.kube != nil {
		return nil
	}
	rc, err := kube.Config(a.c.Kubeconfig)
	if err != nil {
		return err
	}
	rc.UserAgent = "aether-agent"
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("failed to build kubernetes client: %w", err)
	}
	a.kube, a.restConfig = cs, rc
	return nil
}

// nodeLocality reads the node's topology labels from its Node (3 s bound).
func (a *agent) nodeLocality(ctx context.Context) (registry.Locality, error) {
	lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	return kube.NodeLocality(lctx, a.kube, a.c.NodeName)
}

// awaitSync marks the agent ready after the pod source's first sync. An
// agent that started without its Node's locality reads it then (the API
// server answers again) and republishes the pods with it.
func (a *agent) awaitSync(ctx context.Context) error {
	select {
	case <-a.src.Synced():
		if a.localityUnknown {
			if l, err := a.nodeLocality(ctx); err == nil {
				a.mgr.SetLocality(ctx, l)
			} else {
				a.log.Warn("node locality still unknown; serving the one stored with each pod record", "node", a.c.NodeName, "error", err.Error())
			}
		}
		a.mgr.Reconcile(ctx)
		a.mgr.LivenessTick(ctx)
		a.ready.Store(true)
		a.log.Info("agent ready")
		close(a.synced)
	case <-ctx.Done():
	}
	return nil
}

func (a *agent) listenHTTP() (net.Listener, lifecycle.Server, error) {
	ln, err := net.Listen("tcp", a.c.HTTPAddr)
	if err != nil {
		return nil, lifecycle.Server{}, fmt.Errorf("failed to listen on --http-addr %q: %w", a.c.HTTPAddr, err)
	}
	a.log.Info("http listening", "addr", ln.Addr().String())
	srv := &http.Server{Handler: healthMux(a.metrics, &a.ready), ReadHeaderTimeout: 5 * time.Second}
	return ln, lifecycle.HTTP(srv), nil
}

// listenMetrics serves /metrics alone on --metrics-addr: the address a
// Prometheus outside the node scrapes, where /healthz and /readyz (which
// say whether to restart the agent) have no business.
func (a *agent) listenMetrics() (net.Listener, lifecycle.Server, error) {
	ln, err := net.Listen("tcp", a.c.MetricsAddr)
	if err != nil {
		return nil, lifecycle.Server{}, fmt.Errorf("failed to listen on --metrics-addr %q: %w", a.c.MetricsAddr, err)
	}
	a.log.Info("metrics listening", "addr", ln.Addr().String())
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.metrics.Registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	return ln, lifecycle.HTTP(srv), nil
}

func (a *agent) listenCNI() (net.Listener, lifecycle.Server, error) {
	gs, err := cniserver.NewGRPCServer(cniserver.New(a.mgr, a.log.With("component", "cni_server")), cniserver.Options{
		AllowedUIDs: a.c.AllowedUIDs, Tracer: a.tracer, Metrics: a.metrics, Logger: a.log.With("component", "cni_server"),
	})
	if err != nil {
		return nil, lifecycle.Server{}, err
	}
	ln, err := a.listenSocket("cni-socket", a.c.CNISocket)
	if err != nil {
		return nil, lifecycle.Server{}, err
	}
	a.log.Info("cni socket listening", "path", a.c.CNISocket)
	return ln, lifecycle.GRPC(gs), nil
}

func (a *agent) listenAdmin() (net.Listener, lifecycle.Server, error) {
	ln, err := a.listenSocket("admin-socket", a.c.AdminSocket)
	if err != nil {
		return nil, lifecycle.Server{}, err
	}
	opts := adminhandler.Options{AllowedUIDs: a.c.AllowedUIDs, Rejected: a.metrics.PeerRejected.WithLabelValues(telemetry.SocketAdmin), Logger: a.log, InboundPolicy: a.c.InboundPolicy}
	if a.c.CA != nil {
		opts.TrustDomain = a.c.CA.Bundle().TrustDomain()
	}
	srv := &http.Server{
		Handler:           adminhandler.New(a.mgr, opts),
		ReadHeaderTimeout: 5 * time.Second,
		ConnContext:       adminhandler.ConnContext,
	}
	a.log.Info("admin socket listening", "path", a.c.AdminSocket)
	return ln, lifecycle.HTTP(srv), nil
}

// listenSocket opens the unix socket of --flag at path with the one socket
// policy (pkg/unixsock: a missing directory is created 0700, one open to
// group or others is refused), after tightening an open directory that is
// safe to tighten (tightenSocketDir). A refused directory gets an error
// that says why it was not tightened and how to fix it.
func (a *agent) listenSocket(flag, path string) (*net.UnixListener, error) {
	reason, err := a.c.prepareSocketDir(flag, path, a.log)
	if err != nil {
		return nil, err
	}
	ln, err := unixsock.Listen(path)
	if err == nil {
		return ln, nil
	}
	dir := filepath.Dir(path)
	if fi, serr := os.Stat(dir); serr == nil && fi.IsDir() && fi.Mode().Perm()&0o077 != 0 {
		if reason != "" {
			reason = fmt.Sprintf(" (not tightened: %s)", reason)
		}
		return nil, fmt.Errorf("failed to serve --%s %q: %w%s; fix: chmod 0700 %q, or point --%s at a directory only the agent uses (the defaults %s and %s are created 0700)", flag, path, err, reason, dir, flag, SocketDir, ProxySocketDir)
	}
	return nil, err
}

// newRegistry opens the endpoint registry --registry names (client: the
// Kubernetes API, for kube). The etcd backend's count of rejected values is
// exported on metrics as aether_registry_etcd_rejected_total; the close func
// unregisters it.
func newRegistry(c *Config, client kubernetes.Interface, log *slog.Logger, metrics prometheus.Registerer) (registry.Registry, func(), error) {
	switch c.Registry {
	case "etcd":
	case "kube":
		r, err := kubereg.New(kubereg.Options{
			Client: client, Node: c.NodeName, Rules: enrolment.Rules{SystemNamespaces: c.SystemNamespaces, AmbientAlias: c.AmbientNamespaces},
			Logger: log.With("component", "registry_kube"),
		})
		if err != nil {
			return nil, nil, err
		}
		if err := r.Start(); err != nil {
			return nil, nil, err
		}
		return r, r.Close, nil
	default:
		return local.New(), func() {}, nil
	}
	opts := c.etcdOptions()
	opts.Logger = log.With("component", "registry_etcd")
	r, err := etcdreg.New(opts)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to open the etcd registry at %v: %w", c.EtcdEndpoints, err)
	}
	rejected := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "aether_registry_etcd_rejected_total",
		Help: "etcd endpoint values ignored because their key is outside <prefix><node>/<key> or their JSON names another key or node.",
	}, func() float64 { return float64(r.Rejected()) })
	if err := metrics.Register(rejected); err != nil {
		_ = r.Close()
		return nil, nil, fmt.Errorf("failed to register the etcd registry metrics: %w", err)
	}
	return r, func() {
		metrics.Unregister(rejected)
		_ = r.Close()
	}, nil
}

// TracerName is the instrumentation scope of the agent's spans.
const TracerName = "aether-agent"

// newTracer returns the tracer of the agent's spans: exported over
// OTLP/gRPC to endpoint, or a no-op one when endpoint is empty. Spans
// carry the resource service.name aether-agent and k8s.node.name node, so
// a collector tells the nodes apart.
func newTracer(ctx context.Context, endpoint, node string) (trace.Tracer, func(), error) {
	if endpoint == "" {
		return noop.NewTracerProvider().Tracer(TracerName), func() {}, nil
	}
	exp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure())
	if err != nil {
		return nil, nil, fmt.Errorf("failed to create otlp exporter for %q: %w", endpoint, err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(
		attribute.String("service.name", TracerName), attribute.String("k8s.node.name", node)))
	if err != nil {
		return nil, nil, fmt.Errorf("failed to build the trace resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp.Tracer(TracerName), func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = tp.Shutdown(sctx)
	}, nil
}

func healthMux(m *telemetry.Metrics, ready *atomic.Bool) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready.Load() {
			http.Error(w, "not ready: waiting for the first pod-source sync", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

// PodView is one record as the admin API returns it (adminapi.Pod).
type PodView = adminapi.Pod
