package handler

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/agent/cniserver"
	"aether.io/node/agent/identity"
	"aether.io/node/agent/pods"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/meshcontract"
)

// Lister lists the stored pod states and the kept DELs (*pods.Manager
// implements it).
type Lister interface {
	List() []pods.PodState
	LastRemoval(namespace, name string) (pods.Removal, bool)
}

// Options configure NewHandler.
type Options struct {
	// AllowedUIDs may call the API; a peer with any other uid, or whose
	// credentials are unknown, gets 403.
	AllowedUIDs []uint32
	// Rejected counts refused peers; may be nil.
	Rejected prometheus.Counter
	// Logger logs refused peers; nil discards.
	Logger *slog.Logger
	// TrustDomain, when set (identity on), adds each pod's SPIFFE ID.
	TrustDomain spiffeid.TrustDomain
	// InboundPolicy is the agent's --inbound-policy ("" = permissive): the
	// policy of pods without a valid annotation.
	InboundPolicy string
}

type peerKey struct{}

// ConnContext is the http.Server ConnContext that records each connection's
// SO_PEERCRED credentials for the handler's uid check.
func ConnContext(ctx context.Context, conn net.Conn) context.Context {
	if pi, err := cniserver.ConnPeer(conn); err == nil {
		return context.WithValue(ctx, peerKey{}, pi)
	}
	return ctx
}

// New returns the admin API handler over l. Serve it with
// ConnContext on a unix socket: peers are checked before any route.
func New(l Lister, o Options) http.Handler {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	view := func(s pods.PodState) adminapi.Pod {
		v := View(s)
		def := o.InboundPolicy
		if def == "" {
			def = meshcontract.InboundPolicyPermissive
		}
		v.InboundPolicy, v.InboundPolicyInvalid = meshcontract.InboundPolicyOf(s.Record.Pod.GetAnnotations(), def)
		if !o.TrustDomain.IsZero() {
			a := identity.AccountOf(v.Namespace, v.ServiceAccount)
			if id, err := identity.WorkloadID(o.TrustDomain, a.Namespace, a.ServiceAccount); err == nil {
				v.SPIFFEID = id.String()
			}
		}
		return v
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/pods", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		states := l.List()
		out := make([]adminapi.Pod, 0, len(states))
		for _, s := range states {
			out = append(out, view(s))
		}
		writeJSON(w, out)
	})
	mux.HandleFunc("GET /v1/pods/{namespace}/{name}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		ns, name := r.PathValue("namespace"), r.PathValue("name")
		var out []adminapi.Pod
		for _, s := range l.List() {
			if s.Record.Pod.GetNamespace() == ns && s.Record.Pod.GetName() == name {
				out = append(out, view(s))
			}
		}
		if len(out) == 0 {
			nf := adminapi.NotFound{Error: fmt.Sprintf("no record for pod %s/%s", ns, name)}
			if d, ok := l.LastRemoval(ns, name); ok {
				nf.LastDel = RemovalView(d)
			}
			w.WriteHeader(http.StatusNotFound)
			writeJSON(w, nf)
			return
		}
		writeJSON(w, out)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pi, ok := r.Context().Value(peerKey{}).(cniserver.PeerInfo)
		if !ok || !slices.Contains(o.AllowedUIDs, pi.UID) {
			if o.Rejected != nil {
				o.Rejected.Inc()
			}
			log.Warn("admin peer rejected", "path", r.URL.Path, "peer_uid", int64(pi.UID), "peer_known", ok)
			http.Error(w, "permission denied: peer uid not allowed", http.StatusForbidden)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// writeJSON writes v indented; a client that went away is not an error
// worth reporting.
func writeJSON(w http.ResponseWriter, v any) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
