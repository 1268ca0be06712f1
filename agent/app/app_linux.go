package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"k8s.io/client-go/kubernetes"

	"aether.io/node/agent/adminapi"
	"aether.io/node/agent/cniserver"
	"aether.io/node/agent/pods"
	"aether.io/node/agent/podsource"
	"aether.io/node/agent/podsource/kube"
	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
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

// Run runs the agent until ctx ends, then shuts down gracefully.
func Run(ctx context.Context, c *Config, log *slog.Logger) error {
	metrics := telemetry.NewMetrics()

	tracer, shutdownTracing, err := newTracer(ctx, c.OTLPEndpoint)
	if err != nil {
		return err
	}
	defer shutdownTracing()

	// Pod source (no I/O yet).
	var src podsource.Source
	locality := c.Locality
	if c.PodManifests != "" {
		src = manifests.New(c.PodManifests, c.NodeName, c.ManifestInterval, log.With("component", "pod_manifests"))
	} else {
		rc, err := kube.Config(c.Kubeconfig)
		if err != nil {
			return err
		}
		rc.UserAgent = "aether-agent"
		cs, err := kubernetes.NewForConfig(rc)
		if err != nil {
			return fmt.Errorf("failed to build kubernetes client: %w", err)
		}
		src = kube.New(cs, c.NodeName, 0, log.With("component", "pod_source"))
		if locality == (registry.Locality{}) {
			lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			if l, err := kube.NodeLocality(lctx, cs, c.NodeName); err == nil {
				locality = l
			} else {
				log.Warn("node locality unknown", "node", c.NodeName, "error", err.Error())
			}
			cancel()
		}
	}

	st, err := store.Open(c.StateDir, store.Options{
		Logger:       log.With("component", "store"),
		OnQuarantine: func(string, error) { metrics.Quarantined.Inc() },
	})
	if err != nil {
		return err
	}
	defer func() {
		if err := st.Close(); err != nil {
			log.Error("failed to close store", "error", err.Error())
		}
	}()

	reg, closeReg, err := newRegistry(c, log)
	if err != nil {
		return err
	}
	defer closeReg()
	nodeRes := newNodeXDS(c, log)
	mgr := pods.New(pods.Config{
		Node: c.NodeName, Locality: locality, SystemNamespaces: c.SystemNamespaces,
		UDSRoot: c.UDSRoot, PodWait: c.PodWait, Observer: nodeRes,
	}, st, reg, src, nil, metrics, log.With("component", "pods"))

	// Replay before serving anything.
	if _, err := mgr.Replay(ctx); err != nil {
		return err
	}

	var ready atomic.Bool
	httpLn, err := net.Listen("tcp", c.HTTPAddr)
	if err != nil {
		return fmt.Errorf("failed to listen on --http-addr %q: %w", c.HTTPAddr, err)
	}
	httpSrv := &http.Server{Handler: healthMux(metrics, &ready), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = httpSrv.Serve(httpLn) }()
	log.Info("http listening", "addr", httpLn.Addr().String())

	gs, err := cniserver.NewGRPCServer(cniserver.New(mgr, log.With("component", "cni_server")), cniserver.Options{
		AllowedUIDs: c.AllowedUIDs, Tracer: tracer, Metrics: metrics, Logger: log.With("component", "cni_server"),
	})
	if err != nil {
		return err
	}
	cniLn, err := cniserver.Listen(c.CNISocket)
	if err != nil {
		return err
	}
	serveErr := make(chan error, 8)
	go func() { serveErr <- gs.Serve(cniLn) }()
	log.Info("cni socket listening", "path", c.CNISocket)

	var adminSrv *http.Server
	if c.AdminSocket != "" {
		adminLn, err := cniserver.Listen(c.AdminSocket)
		if err != nil {
			gs.Stop()
			return err
		}
		adminSrv = &http.Server{
			Handler: adminMux(mgr, c.AllowedUIDs, metrics, log), ReadHeaderTimeout: 5 * time.Second,
			ConnContext: func(ctx context.Context, conn net.Conn) context.Context {
				if pi, err := cniserver.ConnPeer(conn); err == nil {
					return context.WithValue(ctx, peerKey{}, pi)
				}
				return ctx
			},
		}
		go func() { _ = adminSrv.Serve(adminLn) }()
		log.Info("admin socket listening", "path", c.AdminSocket)
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	// xDS starts after replay, so the first snapshot the proxy sees already
	// holds every stored pod (an empty one would drain them all).
	if _, err := startXDS(runCtx, c, reg, nodeRes, metrics.Registry, log, serveErr); err != nil {
		gs.Stop()
		return err
	}
	go func() {
		if err := src.Run(runCtx, mgr.Handler(runCtx)); err != nil {
			serveErr <- err
		}
	}()
	go func() {
		select {
		case <-src.Synced():
			mgr.Reconcile(runCtx)
			mgr.LivenessTick(runCtx)
			ready.Store(true)
			log.Info("agent ready")
		case <-runCtx.Done():
		}
	}()
	go mgr.RunLiveness(runCtx, c.LivenessInterval)

	select {
	case <-ctx.Done():
		log.Info("shutting down")
	case err = <-serveErr:
		log.Error("agent failed", "error", err.Error())
	}
	ready.Store(false)
	stop()
	done := make(chan struct{})
	go func() { gs.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(c.ShutdownTimeout):
		log.Warn("in-flight rpcs did not finish in time; stopping", "timeout", c.ShutdownTimeout.String())
		gs.Stop()
	}
	sctx, cancel := context.WithTimeout(context.Background(), c.ShutdownTimeout)
	defer cancel()
	_ = httpSrv.Shutdown(sctx)
	if adminSrv != nil {
		_ = adminSrv.Shutdown(sctx)
	}
	log.Info("stopped")
	return err
}

// newRegistry opens the endpoint registry --registry names.
func newRegistry(c *Config, log *slog.Logger) (registry.Registry, func(), error) {
	if c.Registry != "etcd" {
		return local.New(), func() {}, nil
	}
	r, err := etcdreg.New(etcdreg.Options{
		Endpoints: c.EtcdEndpoints, Node: c.NodeName, Prefix: c.EtcdPrefix, LeaseTTL: c.EtcdLeaseTTL,
		CAFile: c.EtcdCAFile, CertFile: c.EtcdCertFile, KeyFile: c.EtcdKeyFile,
		Logger: log.With("component", "registry_etcd"),
	})
	if err != nil {
		return nil, nil, fmt.Errorf("failed to open the etcd registry at %v: %w", c.EtcdEndpoints, err)
	}
	return r, func() { _ = r.Close() }, nil
}

func newTracer(ctx context.Context, endpoint string) (trace.Tracer, func(), error) {
	if endpoint == "" {
		return noop.NewTracerProvider().Tracer("aether-agent"), func() {}, nil
	}
	exp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpoint(endpoint), otlptracegrpc.WithInsecure())
	if err != nil {
		return nil, nil, fmt.Errorf("failed to create otlp exporter for %q: %w", endpoint, err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp))
	return tp.Tracer("aether-agent"), func() {
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

type peerKey struct{}

// PodView is one record as the admin API returns it.
type PodView = adminapi.Pod

// View renders a pod state for the admin API.
func View(s pods.PodState) PodView {
	r := s.Record
	p := r.Pod
	v := PodView{
		Namespace: p.GetNamespace(), Name: p.GetName(), ContainerID: p.GetContainerId(), UID: p.GetUid(),
		IPs: p.GetIps(), NetworkNS: p.GetNetworkNamespace(), ServiceAccount: p.GetServiceAccount(), Labels: p.GetLabels(),
		Managed: true, Terminating: p.GetTerminating(), Registered: s.Registered, Healthy: s.Healthy,
		Uncaptured: r.Uncaptured, UncapturedError: r.UncapturedError, UDSPath: s.UDSPath, UDSRefusal: s.UDSRefusal,
		Volumes: p.GetVolumes(), UDSCSIVolume: p.GetUdsCsiVolume(), UDSCSIVolumes: p.GetUdsCsiVolumes(), AddedAt: r.AddedAt,
	}
	if t := r.LastTimings; t != nil {
		v.LastTimings = map[string]string{}
		if t.GetStarted() != nil {
			v.LastTimings["started"] = t.GetStarted().AsTime().Format(time.RFC3339Nano)
		}
		add := func(k string, set bool, d time.Duration) {
			if set {
				v.LastTimings[k] = d.String()
			}
		}
		add("pre_call", t.GetPreCall() != nil, t.GetPreCall().AsDuration())
		add("readiness_probe", t.GetReadinessProbe() != nil, t.GetReadinessProbe().AsDuration())
		add("capture_divert", t.GetCaptureDivert() != nil, t.GetCaptureDivert().AsDuration())
		add("total", t.GetTotal() != nil, t.GetTotal().AsDuration())
		if e := t.GetReadinessProbeError(); e != "" {
			v.LastTimings["readiness_probe_error"] = e
		}
		if e := t.GetCaptureDivertError(); e != "" {
			v.LastTimings["capture_divert_error"] = e
		}
	}
	return v
}

func adminMux(mgr *pods.Manager, uids []uint32, m *telemetry.Metrics, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/pods", func(w http.ResponseWriter, _ *http.Request) {
		states := mgr.List()
		out := make([]PodView, 0, len(states))
		for _, s := range states {
			out = append(out, View(s))
		}
		writeJSON(w, out)
	})
	mux.HandleFunc("GET /v1/pods/{namespace}/{name}", func(w http.ResponseWriter, r *http.Request) {
		ns, name := r.PathValue("namespace"), r.PathValue("name")
		var out []PodView
		for _, s := range mgr.List() {
			if s.Record.Pod.GetNamespace() == ns && s.Record.Pod.GetName() == name {
				out = append(out, View(s))
			}
		}
		if len(out) == 0 {
			http.Error(w, fmt.Sprintf("no record for pod %s/%s", ns, name), http.StatusNotFound)
			return
		}
		writeJSON(w, out)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pi, ok := r.Context().Value(peerKey{}).(cniserver.PeerInfo)
		if !ok || !slices.Contains(uids, pi.UID) {
			m.PeerRejected.Inc()
			log.Warn("admin peer rejected", "path", r.URL.Path, "peer_uid", int64(pi.UID), "peer_known", ok)
			http.Error(w, "permission denied: peer uid not allowed", http.StatusForbidden)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "broken pipe") {
		return
	}
}
