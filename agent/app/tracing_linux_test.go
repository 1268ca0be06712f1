package app

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
)

var updateGolden = flag.Bool("update", false, "rewrite testdata/otlp-report-add-result.json")

// collector is an OTLP/gRPC trace collector keeping every export.
type collector struct {
	collectortrace.UnimplementedTraceServiceServer
	mu  sync.Mutex
	got []*tracepb.ResourceSpans
}

func (c *collector) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.got = append(c.got, req.GetResourceSpans()...)
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// TestTracesReachCollector: with --otlp-endpoint the CNI RPC spans reach a
// real OTLP/gRPC collector with aether-cni's timings as attributes and the
// agent's resource (service.name, k8s.node.name). What the collector
// receives for one ReportAddResult is testdata/otlp-report-add-result.json
// (ids and times zeroed), the example docs/observability.md shows.
func TestTracesReachCollector(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	col := &collector{}
	gs := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(gs, col)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)

	c := testConfig(t, "--otlp-endpoint", ln.Addr().String())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, c, slog.New(slog.DiscardHandler)) }()
	waitServing(ctx, t, c, done)
	cc, err := grpc.NewClient("unix://"+c.CNISocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := cniv1grpc.NewCNIServiceClient(cc).ReportAddResult(ctx, &cniv1.ReportAddResultRequest{
		ContainerId: "5f2c0e", Name: "web-5d4b8c-x7k2p", Namespace: "shop",
		Timings: &cniv1.PluginTimings{
			Started: timestamppb.New(time.Date(2026, 12, 3, 9, 30, 0, 0, time.UTC)), PreCall: durationpb.New(1200 * time.Microsecond),
			ReadinessProbe: durationpb.New(800 * time.Microsecond), CaptureDivert: durationpb.New(4100 * time.Microsecond), Total: durationpb.New(9300 * time.Microsecond),
		},
	}); err != nil {
		t.Fatal(err)
	}
	cancel() // the stop flushes the batch
	if err := <-done; err != nil {
		t.Fatalf("Run after a clean stop = %v", err)
	}

	col.mu.Lock()
	defer col.mu.Unlock()
	var report *tracepb.ResourceSpans
	for _, rs := range col.got {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				if sp.GetName() == "aether.cni.v1.CNIService/ReportAddResult" {
					report = &tracepb.ResourceSpans{Resource: rs.GetResource(), ScopeSpans: []*tracepb.ScopeSpans{{Scope: ss.GetScope(), Spans: []*tracepb.Span{sp}}}}
				}
			}
		}
	}
	if report == nil {
		t.Fatalf("the collector received no ReportAddResult span: %v", col.got)
	}
	res := attrs(report.GetResource().GetAttributes())
	if res["service.name"] != "aether-agent" || res["k8s.node.name"] != "n1" {
		t.Errorf("resource attributes %v, want service.name aether-agent and k8s.node.name n1", res)
	}
	sp := report.GetScopeSpans()[0].GetSpans()[0]
	got := attrs(sp.GetAttributes())
	for k, v := range map[string]string{
		"aether.cni.plugin.total_ns": "9300000", "aether.cni.plugin.capture_divert_ns": "4100000",
		"k8s.pod.name": "web-5d4b8c-x7k2p", "k8s.namespace.name": "shop", "container.id": "5f2c0e",
	} {
		if got[k] != v {
			t.Errorf("span attribute %s = %q, want %q (all: %v)", k, got[k], v, got)
		}
	}
	if sp.GetKind() != tracepb.Span_SPAN_KIND_SERVER {
		t.Errorf("span kind %v, want server", sp.GetKind())
	}

	// The golden example: ids, times and the SDK's version zeroed.
	norm := proto.Clone(report).(*tracepb.ResourceSpans)
	for _, kv := range norm.GetResource().GetAttributes() {
		if kv.GetKey() == "telemetry.sdk.version" {
			kv.Value = &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: "<otel-go version>"}}
		}
	}
	slices.SortFunc(norm.Resource.Attributes, func(a, b *commonpb.KeyValue) int { return strings.Compare(a.GetKey(), b.GetKey()) })
	s := norm.ScopeSpans[0]
	s.Scope.Version = ""
	ns := s.Spans[0]
	ns.TraceId, ns.SpanId, ns.StartTimeUnixNano, ns.EndTimeUnixNano = nil, nil, 0, 0
	slices.SortFunc(ns.Attributes, func(a, b *commonpb.KeyValue) int { return strings.Compare(a.GetKey(), b.GetKey()) })
	raw, err := protojson.Marshal(norm)
	if err != nil {
		t.Fatal(err)
	}
	// protojson varies its spacing on purpose: indent with encoding/json.
	var buf bytes.Buffer
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		t.Fatal(err)
	}
	b := append(buf.Bytes(), '\n')
	golden := filepath.Join("testdata", "otlp-report-add-result.json")
	if *updateGolden {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(golden, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./agent/app -run TestTracesReachCollector -update)", err)
	}
	if string(want) != string(b) {
		t.Errorf("the collector received (run with -update if intended):\n%s\nwant %s:\n%s", b, golden, want)
	}
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	out := map[string]string{}
	for _, kv := range kvs {
		v := kv.GetValue()
		switch x := v.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			out[kv.GetKey()] = x.StringValue
		case *commonpb.AnyValue_IntValue:
			out[kv.GetKey()] = strconv.FormatInt(x.IntValue, 10)
		case *commonpb.AnyValue_BoolValue:
			out[kv.GetKey()] = map[bool]string{true: "true", false: "false"}[x.BoolValue]
		}
	}
	return out
}
