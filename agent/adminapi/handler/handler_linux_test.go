package handler

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"aether.io/node/agent/cniserver"
	"aether.io/node/agent/pods"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/registry"
)

// fakePods is a Lister with fixed states and kept DELs.
type fakePods struct {
	states   []pods.PodState
	removals map[string]pods.Removal
}

func (f fakePods) List() []pods.PodState { return f.states }

func (f fakePods) LastRemoval(ns, name string) (pods.Removal, bool) {
	r, ok := f.removals[ns+"/"+name]
	return r, ok
}

var delAt = time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)

func removal(id string) pods.Removal {
	return pods.Removal{ContainerID: id, At: delAt, Timings: &cniv1.PluginTimings{
		Started: timestamppb.New(delAt), PreCall: durationpb.New(2 * time.Millisecond),
	}}
}

func state(ns, name, id string) pods.PodState {
	return pods.PodState{
		Record: &store.Record{
			Pod:     &cniv1.CNIPod{Namespace: ns, Name: name, ContainerId: id, Ips: []string{"10.0.0.1"}},
			AddedAt: time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC),
			LastTimings: &cniv1.PluginTimings{
				Total: durationpb.New(3 * time.Millisecond), CaptureDivertError: "nft failed",
			},
		},
		Registered: true, Healthy: true,
	}
}

// serveAdmin serves NewHandler on a unix socket with ConnContext, as the
// agent does, and returns a client of it and the rejection counter.
func serveAdmin(t *testing.T, allowed []uint32, states fakePods) (*adminapi.Client, prometheus.Counter) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	rejected := prometheus.NewCounter(prometheus.CounterOpts{Name: "rejected"})
	srv := &http.Server{
		Handler:     New(states, Options{AllowedUIDs: allowed, Rejected: rejected}),
		ConnContext: ConnContext, ReadHeaderTimeout: 5 * time.Second,
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	return adminapi.NewClient(sock), rejected
}

func TestHandler(t *testing.T) {
	me := uint32(os.Geteuid())
	states := fakePods{
		states:   []pods.PodState{state("shop", "web", "c1"), state("shop", "web", "c2"), state("shop", "db", "c3")},
		removals: map[string]pods.Removal{"shop/gone": removal("c0")},
	}
	for _, tc := range []struct {
		name         string
		allowed      []uint32
		call         func(context.Context, *adminapi.Client) ([]adminapi.Pod, error)
		wantIDs      []string
		wantErr      string
		wantRejected float64
		// wantDel is the last DEL a not-found answer names.
		wantDel *adminapi.Removal
	}{
		{
			name: "list every record", allowed: []uint32{me},
			call:    func(ctx context.Context, c *adminapi.Client) ([]adminapi.Pod, error) { return c.Pods(ctx) },
			wantIDs: []string{"c1", "c2", "c3"},
		},
		{
			name: "records of one pod", allowed: []uint32{me},
			call: func(ctx context.Context, c *adminapi.Client) ([]adminapi.Pod, error) {
				return c.Pod(ctx, "shop", "web")
			},
			wantIDs: []string{"c1", "c2"},
		},
		{
			name: "unknown pod is not found", allowed: []uint32{me},
			call: func(ctx context.Context, c *adminapi.Client) ([]adminapi.Pod, error) {
				return c.Pod(ctx, "shop", "nobody")
			},
			wantErr: adminapi.ErrNotFound.Error(),
		},
		{
			name: "removed pod is not found, with its last DEL", allowed: []uint32{me},
			call: func(ctx context.Context, c *adminapi.Client) ([]adminapi.Pod, error) {
				return c.Pod(ctx, "shop", "gone")
			},
			wantErr: adminapi.ErrNotFound.Error(),
			wantDel: &adminapi.Removal{ContainerID: "c0", At: delAt, Timings: map[string]string{
				"started": "2026-11-30T09:00:00Z", "pre_call": "2ms",
			}},
		},
		{
			name: "peer uid not allowed", allowed: []uint32{me + 4242},
			call:         func(ctx context.Context, c *adminapi.Client) ([]adminapi.Pod, error) { return c.Pods(ctx) },
			wantErr:      "403 Forbidden: permission denied: peer uid not allowed",
			wantRejected: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, rejected := serveAdmin(t, tc.allowed, states)
			got, err := tc.call(context.Background(), c)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				var nf *adminapi.NotFoundError
				if errors.As(err, &nf) && !reflect.DeepEqual(nf.LastDel, tc.wantDel) {
					t.Errorf("not found names last DEL %+v, want %+v", nf.LastDel, tc.wantDel)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, p := range got {
				ids = append(ids, p.ContainerID)
			}
			if strings.Join(ids, ",") != strings.Join(tc.wantIDs, ",") {
				t.Errorf("container ids %v, want %v", ids, tc.wantIDs)
			}
			var m dto.Metric
			if err := rejected.Write(&m); err != nil {
				t.Fatal(err)
			}
			if n := m.GetCounter().GetValue(); n != tc.wantRejected {
				t.Errorf("rejected = %v, want %v", n, tc.wantRejected)
			}
		})
	}
}

// TestHandlerUnknownPeer refuses a connection whose credentials were never
// read (a server without ConnContext, or a TCP peer).
func TestHandlerUnknownPeer(t *testing.T) {
	h := New(fakePods{}, Options{AllowedUIDs: []uint32{0}})
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close(); <-done })
	resp, err := http.Get("http://" + ln.Addr().String() + "/v1/pods")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("status %d, want 403", resp.StatusCode)
	}
}

func TestView(t *testing.T) {
	v := View(state("shop", "web", "c1"))
	if v.Namespace != "shop" || v.Name != "web" || v.ContainerID != "c1" || !v.Managed || !v.Registered || !v.Healthy {
		t.Fatalf("view = %+v", v)
	}
	if v.LastTimings["total"] != "3ms" || v.LastTimings["capture_divert_error"] != "nft failed" {
		t.Fatalf("last timings = %v", v.LastTimings)
	}
	if _, ok := v.LastTimings["pre_call"]; ok {
		t.Fatalf("unset timing rendered: %v", v.LastTimings)
	}
	if v.LastDel != nil {
		t.Fatalf("last DEL of a pod without one: %+v", v.LastDel)
	}
	if v.Owner != "" {
		t.Fatalf("owner of a bare pod = %q, want none", v.Owner)
	}
	if v.DeclaredPortsKnown || v.DeclaredTCPPorts != nil {
		t.Fatalf("declared ports of a record without them = %v %v, want unknown", v.DeclaredPortsKnown, v.DeclaredTCPPorts)
	}
	if v.EnrolledVia != "pod_label" {
		t.Fatalf("enrolled via %q for a record that predates the field, want pod_label (the only way then)", v.EnrolledVia)
	}
	s := state("shop", "web", "c1")
	s.Record.EnrolledVia = "namespace_label"
	if v := View(s); v.EnrolledVia != "namespace_label" {
		t.Fatalf("enrolled via %q, want the record's namespace_label", v.EnrolledVia)
	}
	s.Record.Pod.DeclaredPorts = &cniv1.DeclaredPorts{Tcp: []uint32{80, 8080}}
	if v := View(s); !v.DeclaredPortsKnown || !reflect.DeepEqual(v.DeclaredTCPPorts, []uint32{80, 8080}) {
		t.Fatalf("declared ports = %v %v, want known [80 8080]", v.DeclaredPortsKnown, v.DeclaredTCPPorts)
	}
	s.Record.Owner = &registry.Owner{Kind: "ReplicaSet", Name: "web-5d4b8c"}
	if v := View(s); v.Owner != "ReplicaSet/web-5d4b8c" {
		t.Fatalf("owner = %q, want ReplicaSet/web-5d4b8c", v.Owner)
	}
	d := removal("c0")
	s.LastRemoval = &d
	v = View(s)
	want := &adminapi.Removal{ContainerID: "c0", At: delAt, Timings: map[string]string{"started": "2026-11-30T09:00:00Z", "pre_call": "2ms"}}
	if !reflect.DeepEqual(v.LastDel, want) {
		t.Fatalf("last DEL = %+v, want %+v", v.LastDel, want)
	}
}

// TestHandlerSPIFFEID: with a trust domain (identity on) every pod carries
// its SPIFFE ID, a pod without a service account as "default"; without one
// none does.
func TestHandlerSPIFFEID(t *testing.T) {
	web := state("shop", "web", "c1")
	web.Record.Pod.ServiceAccount = "web-sa"
	bare := state("shop", "bare", "c2")
	states := fakePods{states: []pods.PodState{web, bare}}
	for _, tc := range []struct {
		name string
		td   spiffeid.TrustDomain
		want []string
	}{
		{"identity on", spiffeid.RequireTrustDomainFromString("mesh.example"), []string{"spiffe://mesh.example/ns/shop/sa/web-sa", "spiffe://mesh.example/ns/shop/sa/default"}},
		{"identity off", spiffeid.TrustDomain{}, []string{"", ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := New(states, Options{AllowedUIDs: []uint32{0}, TrustDomain: tc.td})
			req := httptest.NewRequest(http.MethodGet, "/v1/pods", nil)
			req = req.WithContext(context.WithValue(req.Context(), peerKey{}, cniserver.PeerInfo{UID: 0}))
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			var got []adminapi.Pod
			if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || len(got) != 2 {
				t.Fatalf("GET /v1/pods = %d %s (%v)", rec.Code, rec.Body.String(), err)
			}
			for i, p := range got {
				if p.SPIFFEID != tc.want[i] {
					t.Errorf("pod %s SPIFFE ID %q, want %q", p.Name, p.SPIFFEID, tc.want[i])
				}
			}
		})
	}
}
