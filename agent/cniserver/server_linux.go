package cniserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"buf.build/go/protovalidate"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"aether.io/node/agent/pods"
	"aether.io/node/agent/telemetry"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
)

// Server implements cniv1grpc.CNIServiceServer on a pods.Manager.
type Server struct {
	cniv1grpc.UnimplementedCNIServiceServer
	mgr *pods.Manager
	log *slog.Logger
}

// New returns a Server.
func New(mgr *pods.Manager, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{mgr: mgr, log: log}
}

// AddPod implements CNIService.AddPod.
func (s *Server) AddPod(ctx context.Context, req *cniv1.AddPodRequest) (*cniv1.AddPodResponse, error) {
	res, err := s.mgr.AddPod(ctx, req.GetPod(), req.GetPluginTimings())
	if errors.Is(err, pods.ErrPodUnavailable) || errors.Is(err, pods.ErrPodUIDMismatch) {
		return nil, status.Error(grpccodes.Unavailable, err.Error())
	}
	if errors.Is(err, pods.ErrPodOtherNode) {
		// A refusal, not a failure: retrying cannot make the pod this
		// node's.
		return nil, status.Error(grpccodes.PermissionDenied, err.Error())
	}
	if err != nil {
		return nil, status.Error(grpccodes.Internal, err.Error())
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.String("aether.cni.result", res.String()))
	return &cniv1.AddPodResponse{Result: res}, nil
}

// RemovePod implements CNIService.RemovePod.
func (s *Server) RemovePod(ctx context.Context, req *cniv1.RemovePodRequest) (*cniv1.RemovePodResponse, error) {
	res, err := s.mgr.RemovePod(ctx, req.GetNamespace(), req.GetName(), req.GetContainerId(), req.GetPluginTimings())
	if err != nil {
		return nil, status.Error(grpccodes.Internal, err.Error())
	}
	return &cniv1.RemovePodResponse{Result: res}, nil
}

// ReportAddResult implements CNIService.ReportAddResult.
func (s *Server) ReportAddResult(ctx context.Context, req *cniv1.ReportAddResultRequest) (*cniv1.ReportAddResultResponse, error) {
	known, err := s.mgr.ReportAddResult(ctx, req)
	trace.SpanFromContext(ctx).SetAttributes(attribute.Bool("aether.cni.known_container", known))
	if err != nil {
		return nil, status.Error(grpccodes.Internal, err.Error())
	}
	return &cniv1.ReportAddResultResponse{}, nil
}

// GetPod implements CNIService.GetPod (read-only, for CNI CHECK).
func (s *Server) GetPod(_ context.Context, req *cniv1.GetPodRequest) (*cniv1.GetPodResponse, error) {
	st, ok := s.mgr.Get(req.GetContainerId())
	if !ok {
		return nil, status.Errorf(grpccodes.NotFound, "no record for container %q", req.GetContainerId())
	}
	return &cniv1.GetPodResponse{
		Pod: st.Record.Pod, Managed: true, Registered: st.Registered,
		Uncaptured: st.Record.Uncaptured, LastTimings: st.Record.LastTimings,
	}, nil
}

func durAttr(key string, d *durationpb.Duration) []attribute.KeyValue {
	if d == nil {
		return nil
	}
	return []attribute.KeyValue{attribute.Int64(key+"_ns", d.AsDuration().Nanoseconds())}
}

// TimingAttributes renders every set PluginTimings field as span
// attributes (durations in nanoseconds, started as RFC 3339).
func TimingAttributes(t *cniv1.PluginTimings) []attribute.KeyValue {
	if t == nil {
		return nil
	}
	var kv []attribute.KeyValue
	if t.GetStarted() != nil {
		kv = append(kv, attribute.String("aether.cni.plugin.started", t.GetStarted().AsTime().Format("2006-01-02T15:04:05.000000000Z07:00")))
	}
	kv = append(kv, durAttr("aether.cni.plugin.pre_call", t.GetPreCall())...)
	kv = append(kv, durAttr("aether.cni.plugin.readiness_probe", t.GetReadinessProbe())...)
	if t.GetReadinessProbeError() != "" {
		kv = append(kv, attribute.String("aether.cni.plugin.readiness_probe_error", t.GetReadinessProbeError()))
	}
	kv = append(kv, durAttr("aether.cni.plugin.capture_divert", t.GetCaptureDivert())...)
	if t.GetCaptureDivertError() != "" {
		kv = append(kv, attribute.String("aether.cni.plugin.capture_divert_error", t.GetCaptureDivertError()))
	}
	kv = append(kv, durAttr("aether.cni.plugin.total", t.GetTotal())...)
	return kv
}

// Options configure the interceptors.
type Options struct {
	// AllowedUIDs may call the service; empty means uid 0 only.
	AllowedUIDs []uint32
	// Tracer makes one span per RPC; nil means no tracing.
	Tracer trace.Tracer
	// Metrics counts rejected peers; may be nil.
	Metrics *telemetry.Metrics
	// Logger logs rejections.
	Logger *slog.Logger
}

// NewGRPCServer returns a grpc.Server with the SO_PEERCRED credentials, the
// peer, tracing and validation interceptors, and srv registered.
func NewGRPCServer(srv cniv1grpc.CNIServiceServer, o Options) (*grpc.Server, error) {
	v, err := protovalidate.New()
	if err != nil {
		return nil, fmt.Errorf("failed to build request validator: %w", err)
	}
	if len(o.AllowedUIDs) == 0 {
		o.AllowedUIDs = []uint32{0}
	}
	if o.Tracer == nil {
		o.Tracer = noop.NewTracerProvider().Tracer("")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	ic := &interceptor{o: o, v: v}
	g := grpc.NewServer(grpc.Creds(PeerCredentials()), grpc.ChainUnaryInterceptor(ic.unary))
	cniv1grpc.RegisterCNIServiceServer(g, srv)
	return g, nil
}

type interceptor struct {
	o Options
	v protovalidate.Validator
}

func (ic *interceptor) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	uid, ok := PeerUID(ctx)
	if !ok || !slices.Contains(ic.o.AllowedUIDs, uid) {
		if ic.o.Metrics != nil {
			ic.o.Metrics.PeerRejected.WithLabelValues(telemetry.SocketCNI).Inc()
		}
		pid := int32(-1)
		if p, ok := peer.FromContext(ctx); ok {
			if pi, ok := p.AuthInfo.(PeerInfo); ok {
				pid = pi.PID
			}
		}
		ic.o.Logger.Warn("cni peer rejected", "method", info.FullMethod, "peer_uid", int64(uid), "peer_known", ok, "peer_pid", pid)
		return nil, status.Errorf(grpccodes.PermissionDenied, "peer uid %d may not call %s (allowed uids: %v)", uid, info.FullMethod, ic.o.AllowedUIDs)
	}
	ctx, span := ic.o.Tracer.Start(ctx, strings.TrimPrefix(info.FullMethod, "/"), trace.WithSpanKind(trace.SpanKindServer))
	defer span.End()
	if m, ok := req.(proto.Message); ok {
		if err := ic.v.Validate(m); err != nil {
			span.SetStatus(codes.Error, "invalid request")
			return nil, status.Error(grpccodes.InvalidArgument, "invalid request: "+describe(err))
		}
	}
	// Attributes are built only for a span that keeps them: without a
	// tracer, AddPod's hot path allocates nothing for tracing.
	recording := span.IsRecording()
	if recording {
		span.SetAttributes(requestAttributes(req)...)
	}
	resp, err := h(ctx, req)
	if err != nil && recording {
		span.SetStatus(codes.Error, err.Error())
	}
	if r, ok := req.(*cniv1.ReportAddResultRequest); ok && err == nil && ic.o.Metrics != nil {
		observeAddTimings(ic.o.Metrics, r.GetTimings())
	}
	return resp, err
}

// observeAddTimings adds an ADD's reported phases to
// aether_cni_add_duration_seconds; a phase the plugin did not time (a
// disabled probe, a plugin that predates timings) is not observed.
func observeAddTimings(m *telemetry.Metrics, t *cniv1.PluginTimings) {
	for i, d := range []*durationpb.Duration{t.GetTotal(), t.GetPreCall(), t.GetReadinessProbe(), t.GetCaptureDivert()} {
		if d != nil {
			m.CNIAddDuration.WithLabelValues(telemetry.CNIPhases[i]).Observe(d.AsDuration().Seconds())
		}
	}
}

// requestAttributes are the span attributes of a request: the pod's
// identity and, on every RPC that carries them, the plugin's timings.
func requestAttributes(req any) []attribute.KeyValue {
	switch r := req.(type) {
	case *cniv1.AddPodRequest:
		return append(podAttributes(r.GetPod().GetNamespace(), r.GetPod().GetName(), r.GetPod().GetContainerId()),
			TimingAttributes(r.GetPluginTimings())...)
	case *cniv1.RemovePodRequest:
		return append(podAttributes(r.GetNamespace(), r.GetName(), r.GetContainerId()), TimingAttributes(r.GetPluginTimings())...)
	case *cniv1.ReportAddResultRequest:
		return append(podAttributes(r.GetNamespace(), r.GetName(), r.GetContainerId()), TimingAttributes(r.GetTimings())...)
	case *cniv1.GetPodRequest:
		return []attribute.KeyValue{attribute.String("container.id", r.GetContainerId())}
	}
	return nil
}

func podAttributes(ns, name, containerID string) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("k8s.namespace.name", ns), attribute.String("k8s.pod.name", name), attribute.String("container.id", containerID),
	}
}

// describe names every violated rule: "field: message [rule id]".
func describe(err error) string {
	var ve *protovalidate.ValidationError
	if !errors.As(err, &ve) {
		return err.Error()
	}
	var parts []string
	for _, v := range ve.Violations {
		pb := v.Proto
		parts = append(parts, fmt.Sprintf("%s: %s [%s]", protovalidate.FieldPathString(pb.GetField()), pb.GetMessage(), pb.GetRuleId()))
	}
	return strings.Join(parts, "; ")
}
