// Package enivlantest holds eni-vlan's test fixtures, shared by the plugin's
// netns tests, the real-VLAN end-to-end suite (VM lane) and demos: a fake
// spiderpool-agent serving the real API shape on a unix socket, and a
// "cloud fabric" namespace whose gateway answers ARP/NDP only for bound
// IP+MAC(+VLAN) triples, as IaaS anti-spoofing fabrics do.
package enivlantest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Answer programs how the fake agent answers a GetWorkloadEndpoint call.
type Answer int

// Answers the fake agent can give.
const (
	// OK answers 200 with the binding.
	OK Answer = iota
	// NotFound answers 404, as the agent does before its informer cache
	// has seen the SpiderEndpoint.
	NotFound
	// ServerError answers 500.
	ServerError
	// Unprocessable answers 422, go-openapi's answer to bad parameters.
	Unprocessable
	// MissingVLAN answers 200 without "vlan" (the agent omits 0).
	MissingVLAN
	// MissingMAC answers 200 without "mac" (the agent omits "").
	MissingMAC
	// MissingRequired answers 200 without the required "node" field.
	MissingRequired
)

// Binding is what the fake agent (and the fabric) know about one pod.
type Binding struct {
	// Namespace, Name and UID identify the pod.
	Namespace, Name, UID string
	// ContainerID is the sandbox the IPAM allocation belongs to; the
	// resolver uses it to find the IPs IPAM allocated.
	ContainerID string
	// IfName is the interface entry's name ("eth0" when empty).
	IfName string
	// VLAN is the VLAN ID the agent reports.
	VLAN int
	// MAC is the sub-ENI MAC the agent reports.
	MAC string
	// FabricVLAN is the VLAN the fabric really binds (default VLAN); a
	// difference models a wrong agent answer.
	FabricVLAN int
	// FabricMAC is the MAC the fabric really binds (default MAC).
	FabricMAC string
	// NotEffective keeps the binding out of the fabric (not pushed yet).
	NotEffective bool
	// Answer is the agent's answer.
	Answer Answer
	// NotFoundFirst answers 404 to the first lookups before Answer (the
	// informer cache has not seen the SpiderEndpoint yet).
	NotFoundFirst int
	// IncompleteFirst answers the next lookups (after NotFoundFirst)
	// without "vlan" and "mac", as an agent whose cache has the endpoint
	// but not yet the cloud binding does.
	IncompleteFirst int
	// Delay delays every answer (a slow agent).
	Delay time.Duration
	// IPv4, IPv6 (CIDR) and the gateways are reported as given; the Cloud
	// fixture's resolver fills them from the IPAM store when empty.
	IPv4, IPv6, IPv4Gateway, IPv6Gateway string
	// ReportUID overrides the podUID the agent reports (stale record).
	ReportUID string
}

func key(ns, name string) string { return ns + "/" + name }

// Agent is a fake spiderpool-agent on a unix socket.
type Agent struct {
	// Socket is the unix socket path.
	Socket string
	// Resolve, when set, completes a binding before a 200 answer (the
	// Cloud fixture fills the IPs from IPAM and programs the fabric).
	Resolve func(b *Binding) error
	// Default, when set, makes a binding for pods nobody bound.
	Default func(ns, name string) *Binding

	healthy  atomic.Bool
	requests atomic.Int64
	mu       sync.Mutex
	bindings map[string]*Binding
	lookups  map[string]int
	srv      *http.Server
}

// StartAgent starts a fake agent on a fresh short socket path and stops it
// in t.Cleanup.
func StartAgent(tb testing.TB) *Agent {
	tb.Helper()
	dir, err := os.MkdirTemp("", "evag")
	if err != nil {
		tb.Fatal(err)
	}
	a := &Agent{Socket: filepath.Join(dir, "spiderpool.sock"), bindings: map[string]*Binding{}, lookups: map[string]int{}}
	a.healthy.Store(true)
	l, err := net.Listen("unix", a.Socket)
	if err != nil {
		tb.Fatalf("failed to listen on %s: %v", a.Socket, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/ipam/healthy", a.handleHealthy)
	mux.HandleFunc("GET /v1/workloadendpoint", a.handleEndpoint)
	a.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = a.srv.Serve(l) }()
	tb.Cleanup(func() {
		_ = a.srv.Close()
		_ = os.RemoveAll(dir)
	})
	return a
}

// SetHealthy sets the answer of GET /v1/ipam/healthy (200 or 500).
func (a *Agent) SetHealthy(ok bool) { a.healthy.Store(ok) }

// Set adds or replaces a binding.
func (a *Agent) Set(b Binding) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if b.IfName == "" {
		b.IfName = "eth0"
	}
	a.bindings[key(b.Namespace, b.Name)] = &b
	a.lookups[key(b.Namespace, b.Name)] = 0
}

// Remove forgets a pod (its endpoint is gone: 404).
func (a *Agent) Remove(ns, name string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.bindings, key(ns, name))
}

// Lookups returns how many GetWorkloadEndpoint calls asked for the pod.
func (a *Agent) Lookups(ns, name string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.lookups[key(ns, name)]
}

// Requests returns the number of requests served.
func (a *Agent) Requests() int64 { return a.requests.Load() }

func (a *Agent) handleHealthy(w http.ResponseWriter, _ *http.Request) {
	a.requests.Add(1)
	if !a.healthy.Load() {
		writeJSON(w, http.StatusInternalServerError, "spiderpool-agent is not ready")
		return
	}
	w.WriteHeader(http.StatusOK)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func (a *Agent) handleEndpoint(w http.ResponseWriter, r *http.Request) {
	a.requests.Add(1)
	ns, name := r.URL.Query().Get("podNamespace"), r.URL.Query().Get("podName")
	if ns == "" || name == "" {
		// go-openapi's CompositeValidationError, served as 422.
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"code": 602, "message": "podNamespace in query is required"})
		return
	}
	a.mu.Lock()
	b, ok := a.bindings[key(ns, name)]
	if !ok && a.Default != nil {
		if d := a.Default(ns, name); d != nil {
			if d.IfName == "" {
				d.IfName = "eth0"
			}
			b, ok = d, true
		}
	}
	n := a.lookups[key(ns, name)]
	a.lookups[key(ns, name)] = n + 1
	var cp Binding
	if ok {
		cp = *b
	}
	a.mu.Unlock()
	if ok && cp.Delay > 0 {
		select {
		case <-time.After(cp.Delay):
		case <-r.Context().Done():
			return
		}
	}
	if !ok || n < cp.NotFoundFirst || cp.Answer == NotFound {
		writeJSON(w, http.StatusNotFound, fmt.Sprintf("SpiderEndpoint not found for pod %s/%s", ns, name))
		return
	}
	switch cp.Answer {
	case ServerError:
		writeJSON(w, http.StatusInternalServerError, "failed to get workloadendpoint: etcdserver: request timed out")
		return
	case Unprocessable:
		writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"code": 606, "message": "podName in query should match pattern"})
		return
	}
	if n < cp.NotFoundFirst+cp.IncompleteFirst {
		cp.VLAN, cp.MAC = 0, ""
	}
	if a.Resolve != nil && cp.VLAN != 0 {
		if err := a.Resolve(&cp); err != nil {
			writeJSON(w, http.StatusInternalServerError, "resolve: "+err.Error())
			return
		}
	}
	writeJSON(w, http.StatusOK, Render(&cp))
}

// Render returns the 200 body spiderpool-agent would send for b (the
// models.WorkloadEndpointStatus JSON shape).
func Render(b *Binding) map[string]any {
	in := map[string]any{"interface": b.IfName}
	for k, v := range map[string]string{"ipv4": b.IPv4, "ipv6": b.IPv6, "ipv4Gateway": b.IPv4Gateway, "ipv6Gateway": b.IPv6Gateway} {
		if v != "" {
			in[k] = v
		}
	}
	if b.IPv4 != "" {
		in["ipv4Pool"] = "default-v4-ippool"
	}
	if b.MAC != "" && b.Answer != MissingMAC {
		in["mac"] = b.MAC
	}
	if b.VLAN != 0 && b.Answer != MissingVLAN {
		in["vlan"] = b.VLAN
	}
	uid := b.UID
	if b.ReportUID != "" {
		uid = b.ReportUID
	}
	out := map[string]any{
		"podNamespace": b.Namespace,
		"podName":      b.Name,
		"podUID":       uid,
		"node":         "node-1",
		"interfaces":   []any{in},
	}
	if b.Answer == MissingRequired {
		delete(out, "node")
	}
	return out
}

// CheckCloserTook makes tb fail at its end if the plugin log at path says
// that an ADD closed its pre-flight sockets itself because the socket
// closer (preflight.NewExecCloser) could not take them: on a supported
// architecture the closer must start and hold them on every kernel the
// tests run on.
func CheckCloserTook(tb testing.TB, path string) {
	tb.Helper()
	tb.Cleanup(func() {
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			return // no plugin call logged anything
		}
		if err != nil {
			tb.Errorf("read plugin log: %v", err)
			return
		}
		if i := bytes.Index(b, []byte("failed to hand packet sockets to a closer")); i >= 0 {
			line, _, _ := bytes.Cut(b[i:], []byte("\n"))
			tb.Errorf("an ADD closed its sockets itself: %s", line)
		}
	})
}
