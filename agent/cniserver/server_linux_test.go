package cniserver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"aether.io/node/agent/pods"
	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/registry/local"
)

// serve runs a CNIService whose pod source is the returned manifest dir.
func serve(t *testing.T, allowed []uint32) (cniv1grpc.CNIServiceClient, *tracetest.SpanRecorder, string) {
	t.Helper()
	c, rec, mdir, _ := serveWithMetrics(t, allowed)
	return c, rec, mdir
}

// serveWithMetrics is serve that also returns the agent metrics the
// server records on.
func serveWithMetrics(t *testing.T, allowed []uint32) (cniv1grpc.CNIServiceClient, *tracetest.SpanRecorder, string, *telemetry.Metrics) {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "state"), store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	mdir := filepath.Join(dir, "m")
	os.Mkdir(mdir, 0o755)
	src := manifests.New(mdir, "n", time.Hour, nil)
	m := telemetry.NewMetrics()
	mgr := pods.New(pods.Config{Node: "n", PodWait: 100 * time.Millisecond}, st, local.New(), src, nil, m, nil)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	gs, err := NewGRPCServer(New(mgr, nil), Options{AllowedUIDs: allowed, Tracer: tp.Tracer("t"), Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "run", "cni.sock")
	if err := os.Mkdir(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := unixsock.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cniv1grpc.NewCNIServiceClient(cc), rec, mdir, m
}

// TestReportAddResultDurations: each reported phase of an ADD is one
// observation of aether_cni_add_duration_seconds{phase} (what the
// dashboard's CNI latency panel reads); a phase the plugin did not time
// (no readiness probe) is not observed.
func TestReportAddResultDurations(t *testing.T) {
	c, _, _, m := serveWithMetrics(t, []uint32{uint32(os.Geteuid())})
	for range 2 {
		if _, err := c.ReportAddResult(context.Background(), &cniv1.ReportAddResultRequest{
			ContainerId: "c1", Name: "p", Namespace: "ns",
			Timings: &cniv1.PluginTimings{PreCall: durationpb.New(time.Millisecond), CaptureDivert: durationpb.New(3 * time.Millisecond), Total: durationpb.New(7 * time.Millisecond)},
		}); err != nil {
			t.Fatal(err)
		}
	}
	type obs struct {
		count uint64
		sum   float64
	}
	got := map[string]obs{}
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "aether_cni_add_duration_seconds" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			got[mt.GetLabel()[0].GetValue()] = obs{mt.GetHistogram().GetSampleCount(), mt.GetHistogram().GetSampleSum()}
		}
	}
	want := map[string]obs{"total": {2, 0.014}, "pre_call": {2, 0.002}, "readiness_probe": {0, 0}, "capture_divert": {2, 0.006}}
	for phase, w := range want {
		g, ok := got[phase]
		if !ok || g.count != w.count || g.sum < w.sum-1e-9 || g.sum > w.sum+1e-9 {
			t.Errorf("aether_cni_add_duration_seconds{phase=%q} = %d observations summing %v (present %v), want %d summing %v", phase, g.count, g.sum, ok, w.count, w.sum)
		}
	}
}

func TestReportAddResultSpanAttributes(t *testing.T) {
	c, rec, _ := serve(t, []uint32{uint32(os.Geteuid())})
	started := time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)
	_, err := c.ReportAddResult(context.Background(), &cniv1.ReportAddResultRequest{
		ContainerId: "c1", Name: "p", Namespace: "ns",
		Timings: &cniv1.PluginTimings{
			Started: timestamppb.New(started), PreCall: durationpb.New(time.Millisecond),
			ReadinessProbe: durationpb.New(2 * time.Millisecond), ReadinessProbeError: "timeout",
			CaptureDivert: durationpb.New(3 * time.Millisecond), CaptureDivertError: "nft failed", Total: durationpb.New(7 * time.Millisecond),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	spans := rec.Ended()
	if len(spans) != 1 || spans[0].Name() != "aether.cni.v1.CNIService/ReportAddResult" {
		t.Fatalf("spans = %v", spans)
	}
	got := map[string]string{}
	for _, kv := range spans[0].Attributes() {
		got[string(kv.Key)] = kv.Value.String()
	}
	for k, v := range map[string]string{
		"aether.cni.plugin.started":               "2026-11-29T10:00:00.000000000Z",
		"aether.cni.plugin.pre_call_ns":           "1000000",
		"aether.cni.plugin.readiness_probe_ns":    "2000000",
		"aether.cni.plugin.readiness_probe_error": "timeout",
		"aether.cni.plugin.capture_divert_ns":     "3000000",
		"aether.cni.plugin.capture_divert_error":  "nft failed",
		"aether.cni.plugin.total_ns":              "7000000",
		"aether.cni.known_container":              "false",
		"container.id":                            "c1",
	} {
		if got[k] != v {
			t.Errorf("attribute %s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
}

// TestPluginTimingsOnEveryRPCSpan: AddPod and RemovePod record their
// plugin_timings on their own span, as ReportAddResult does; a request of
// the old shape (no plugin_timings) is served as before and its span
// carries no timing attributes.
func TestPluginTimingsOnEveryRPCSpan(t *testing.T) {
	c, rec, mdir := serve(t, []uint32{uint32(os.Geteuid())})
	manifest := `apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, uid: uid-web, labels: {aether.io/managed: "true"}}
spec: {nodeName: "n", containers: [{name: c, image: pause}]}
`
	if err := os.WriteFile(filepath.Join(mdir, "web.yaml"), []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	started := time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)
	timings := &cniv1.PluginTimings{Started: timestamppb.New(started), PreCall: durationpb.New(4 * time.Millisecond)}
	pod := &cniv1.CNIPod{Name: "web", Namespace: "shop", ContainerId: "c1", NetworkNamespace: "/n", Ips: []string{"10.0.0.1"}}
	wantTimings := map[string]string{
		"aether.cni.plugin.started":     "2026-11-29T10:00:00.000000000Z",
		"aether.cni.plugin.pre_call_ns": "4000000",
	}
	for _, tc := range []struct {
		name     string
		call     func(ctx context.Context) error
		span     string
		timings  bool
		wantMore map[string]string
	}{
		{
			name: "AddPod with plugin_timings", span: "aether.cni.v1.CNIService/AddPod", timings: true,
			call: func(ctx context.Context) error {
				r, err := c.AddPod(ctx, &cniv1.AddPodRequest{Pod: pod, PluginTimings: timings})
				return want(r.GetResult() == cniv1.AddPodResponse_RESULT_SUCCESS, err, r)
			},
			wantMore: map[string]string{"aether.cni.result": "RESULT_SUCCESS", "container.id": "c1"},
		},
		{
			name: "AddPod of the old shape", span: "aether.cni.v1.CNIService/AddPod",
			call: func(ctx context.Context) error {
				r, err := c.AddPod(ctx, &cniv1.AddPodRequest{Pod: pod})
				return want(r.GetResult() == cniv1.AddPodResponse_RESULT_SUCCESS, err, r)
			},
			wantMore: map[string]string{"aether.cni.result": "RESULT_SUCCESS", "container.id": "c1"},
		},
		{
			name: "RemovePod with plugin_timings", span: "aether.cni.v1.CNIService/RemovePod", timings: true,
			call: func(ctx context.Context) error {
				r, err := c.RemovePod(ctx, &cniv1.RemovePodRequest{Name: "web", Namespace: "shop", ContainerId: "c1", PluginTimings: timings})
				return want(r.GetResult() == cniv1.RemovePodResponse_RESULT_SUCCESS, err, r)
			},
			wantMore: map[string]string{"k8s.pod.name": "web", "container.id": "c1"},
		},
		{
			name: "RemovePod of the old shape", span: "aether.cni.v1.CNIService/RemovePod",
			call: func(ctx context.Context) error {
				r, err := c.RemovePod(ctx, &cniv1.RemovePodRequest{Name: "web", Namespace: "shop", ContainerId: "c1"})
				return want(r.GetResult() == cniv1.RemovePodResponse_RESULT_SUCCESS, err, r)
			},
			wantMore: map[string]string{"k8s.pod.name": "web", "container.id": "c1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec.Reset()
			if err := tc.call(context.Background()); err != nil {
				t.Fatal(err)
			}
			spans := rec.Ended()
			if len(spans) != 1 || spans[0].Name() != tc.span {
				t.Fatalf("spans = %v, want one %s", spans, tc.span)
			}
			got := map[string]string{}
			for _, kv := range spans[0].Attributes() {
				got[string(kv.Key)] = kv.Value.String()
			}
			for k, v := range tc.wantMore {
				if got[k] != v {
					t.Errorf("attribute %s = %q, want %q (all: %v)", k, got[k], v, got)
				}
			}
			for k, v := range wantTimings {
				if tc.timings && got[k] != v {
					t.Errorf("attribute %s = %q, want %q (all: %v)", k, got[k], v, got)
				}
				if _, ok := got[k]; !tc.timings && ok {
					t.Errorf("old-shape request has attribute %s (all: %v)", k, got)
				}
			}
		})
	}
}

// want turns an RPC's outcome into an error when it failed or ok is false.
func want(ok bool, err error, resp any) error {
	if err != nil {
		return err
	}
	if !ok {
		return status.Errorf(codes.Unknown, "unexpected answer %v", resp)
	}
	return nil
}

func TestValidationAndPeer(t *testing.T) {
	c, _, _ := serve(t, []uint32{uint32(os.Geteuid())})
	for _, tc := range []struct {
		name string
		req  *cniv1.AddPodRequest
		want string
	}{
		{"no pod", &cniv1.AddPodRequest{}, "pod: value is required [required]"},
		{"bad ip", &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{Name: "a", Namespace: "b", ContainerId: "c", NetworkNamespace: "/n", Ips: []string{"1.2.3"}}}, "pod.ips[0]"},
		{"long ns", &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{Name: "a", Namespace: string(make([]byte, 64)), ContainerId: "c", NetworkNamespace: "/n"}}, "[string.max_len]"},
	} {
		_, err := c.AddPod(context.Background(), tc.req)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
			t.Errorf("%s: %v, want InvalidArgument containing %q", tc.name, err, tc.want)
		}
	}
	// Unknown pod: Unavailable after the (100ms) pod wait.
	_, err := c.AddPod(context.Background(), &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{Name: "a", Namespace: "b", ContainerId: "c", NetworkNamespace: "/n", Ips: []string{"10.0.0.1"}}})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("unknown pod: %v, want Unavailable", err)
	}
	// Our own uid not allowed → PermissionDenied before validation.
	c2, _, _ := serve(t, []uint32{uint32(os.Geteuid()) + 4242})
	if _, err := c2.GetPod(context.Background(), &cniv1.GetPodRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("disallowed uid: %v, want PermissionDenied", err)
	}
}

// TestAddPodUIDMismatchUnavailable: a request whose uid is not the pod
// source's pod of that name (a re-created pod the source has not seen yet)
// answers Unavailable (aether-cni: code 11) naming both uids, and leaves
// no record.
func TestAddPodUIDMismatchUnavailable(t *testing.T) {
	c, _, mdir := serve(t, []uint32{uint32(os.Geteuid())})
	manifest := `apiVersion: v1
kind: Pod
metadata: {name: db-0, namespace: shop, uid: uid-old, labels: {aether.io/managed: "true"}}
spec: {nodeName: "n", containers: [{name: c, image: pause}]}
`
	if err := os.WriteFile(filepath.Join(mdir, "db-0.yaml"), []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	pod := &cniv1.CNIPod{Name: "db-0", Namespace: "shop", Uid: "uid-new", ContainerId: "c-new", NetworkNamespace: "/n", Ips: []string{"10.0.0.1"}}
	_, err := c.AddPod(context.Background(), &cniv1.AddPodRequest{Pod: pod})
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.Unavailable || !strings.Contains(msg, "uid-old") || !strings.Contains(msg, "uid-new") {
		t.Fatalf("AddPod with another uid = %v, want Unavailable naming uid-old and uid-new", err)
	}
	if _, err := c.GetPod(context.Background(), &cniv1.GetPodRequest{ContainerId: "c-new"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetPod after a refused AddPod = %v, want NotFound", err)
	}
	pod.Uid = "uid-old"
	if r, err := c.AddPod(context.Background(), &cniv1.AddPodRequest{Pod: pod}); err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod with the source's uid = %v, %v", r, err)
	}
}
