package workload

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// ServerOptions configure a Server.
type ServerOptions struct {
	// Logger receives stream open/close and NACK records; nil discards.
	Logger *slog.Logger
	// Registerer receives the server's metrics; nil keeps them unregistered.
	Registerer prometheus.Registerer
}

// NACK is the last response a client rejected.
type NACK struct {
	// Time is when it arrived.
	Time time.Time
	// Protocol is "delta" or "sotw".
	Protocol string
	// Node is the client's node id.
	Node string
	// Nonce is the rejected response's nonce.
	Nonce string
	// Message is the client's error_detail message.
	Message string
}

// Server serves the index over the Aggregated Discovery Service, Delta and
// SotW, for resource.WorkloadType and, from the index's Address view
// (Index.Addresses), resource.AddressType; one stream may subscribe to
// both, as ztunnel's does. Requests for other types are ignored. It sees
// each index only as a Cache: the cache selects, the server speaks the
// protocol. Resources are never marshalled per client: every stream sends
// the shared, once-marshalled Resource entries.
type Server struct {
	caches  map[string]Cache // by type URL
	log     *slog.Logger
	m       *metrics
	streams atomic.Int64
	// stopped is closed by Stop: every stream ends with Unavailable.
	stopped  chan struct{}
	stopOnce sync.Once

	mu       sync.Mutex
	lastNACK *NACK
}

var _ discovery.AggregatedDiscoveryServiceServer = (*Server)(nil)

// NewServer returns a server of idx. It does no I/O; register it on a
// grpc.Server with Register or run it with Serve.
func NewServer(idx *Index, opts ServerOptions) (*Server, error) {
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	idx.ObserveSize(func(n int) { m.workloads.Set(float64(n)) })
	caches := map[string]Cache{idx.TypeURL(): idx}
	if a := idx.Addresses(); a != nil {
		caches[a.TypeURL()] = a
		a.ObserveSize(func(n int) { m.addresses.Set(float64(n)) })
	}
	if a := idx.Authorizations(); a != nil {
		caches[a.TypeURL()] = a
	}
	return &Server{caches: caches, log: log, m: m, stopped: make(chan struct{})}, nil
}

// Stop ends every open stream, and every stream opened later, with
// Unavailable (clients reconnect, with initial_resource_versions, to the
// next server), so a graceful gRPC stop need not wait for clients to
// leave.
func (s *Server) Stop() { s.stopOnce.Do(func() { close(s.stopped) }) }

// Register registers the ADS service on g.
func (s *Server) Register(g *grpc.Server) {
	discovery.RegisterAggregatedDiscoveryServiceServer(g, s)
}

// LastNACK returns the last NACK any client sent, or nil.
func (s *Server) LastNACK() *NACK {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lastNACK == nil {
		return nil
	}
	n := *s.lastNACK
	return &n
}

func (s *Server) nack(protocol, node, nonce, message string) {
	s.m.nacked(protocol, node, message)
	s.mu.Lock()
	s.lastNACK = &NACK{Time: time.Now(), Protocol: protocol, Node: node, Nonce: nonce, Message: message}
	s.mu.Unlock()
	s.log.Warn("xds client rejected a response", "protocol", protocol, "node", node, "nonce", nonce, "error", message)
}

// ServerGRPCOptions are the grpc.Server options the xDS server needs: its
// codec (pre-encoded responses, fast initial_resource_versions decoding; see
// codec.go), a receive limit large enough for initial_resource_versions
// (0 = 256 MiB) and flow-control windows that let such a request arrive in
// one go. A server built without them still works, only slower.
func ServerGRPCOptions(maxMessageBytes int) []grpc.ServerOption {
	return append([]grpc.ServerOption{grpc.ForceServerCodecV2(newCodec())}, transportOptions(maxMessageBytes)...)
}

func transportOptions(maxMessageBytes int) []grpc.ServerOption {
	if maxMessageBytes <= 0 {
		maxMessageBytes = 256 << 20
	}
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(maxMessageBytes),
		// A reconnect's initial_resource_versions is megabytes; with the
		// default 64 KiB windows it would take many round trips to arrive.
		grpc.InitialWindowSize(8 << 20),
		grpc.InitialConnWindowSize(16 << 20),
	}
}

// serveStream is the loop of one ADS stream, Delta or SotW: client requests
// go to handle, index changes to changed, until the client leaves (nil) or
// ctx ends.
func serveStream[T any](s *Server, ctx context.Context, protocol string, id int64, node func() string,
	recv func() (T, error), notify <-chan struct{}, handle func(T) error, changed func() error,
) error {
	select {
	case <-s.stopped:
		return status.Error(codes.Unavailable, "the server is shutting down")
	default:
	}
	s.m.clients.WithLabelValues(protocol).Inc()
	defer s.m.clients.WithLabelValues(protocol).Dec()
	reqs := make(chan T)
	errc := make(chan error, 1)
	go recvLoop(ctx, recv, reqs, errc)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.stopped:
			return status.Error(codes.Unavailable, "the server is shutting down")
		case err := <-errc:
			s.log.Debug("xds stream closed", "protocol", protocol, "stream", id, "node", node(), "error", err)
			return nil
		case req := <-reqs:
			if err := handle(req); err != nil {
				return err
			}
		case <-notify:
			if err := changed(); err != nil {
				return err
			}
		}
	}
}

// recvLoop forwards requests from recv until it fails.
func recvLoop[T any](ctx context.Context, recv func() (T, error), out chan<- T, errc chan<- error) {
	for {
		req, err := recv()
		if err != nil {
			errc <- err
			return
		}
		select {
		case out <- req:
		case <-ctx.Done():
			return
		}
	}
}

// request is what Delta and SotW requests have in common.
type request interface {
	GetNode() *core.Node
	GetTypeUrl() string
}

// accept records the client's node id from the first request that names
// one and returns the cache of the request's type, or nil for a type this
// server does not serve (ignored, as an ADS server does for types it does
// not know).
func (s *Server) accept(node *string, req request) Cache {
	if *node == "" && req.GetNode() != nil {
		*node = req.GetNode().GetId()
	}
	c := s.caches[req.GetTypeUrl()]
	if c == nil {
		s.log.Debug("ignoring xds request for an unserved type", "type_url", req.GetTypeUrl(), "node", *node)
	}
	return c
}

// streamTypes is the per-type state of one ADS stream: each type the
// client subscribes to has its own Subscription, all signalling the one
// notify channel the stream's loop waits on.
type streamTypes[T any] struct {
	notify chan struct{}
	types  map[string]*T
	order  []*T // in the order the client first asked, for stable flushes
	cancel []func()
}

func newStreamTypes[T any]() *streamTypes[T] {
	return &streamTypes[T]{notify: make(chan struct{}, 1), types: make(map[string]*T)}
}

// get returns the state of c's type, made by mk with a new subscription
// the first time.
func (t *streamTypes[T]) get(c Cache, mk func(Cache, *Subscription) *T) *T {
	if st, ok := t.types[c.TypeURL()]; ok {
		return st
	}
	sub, cancel := c.Subscribe(t.notify)
	st := mk(c, sub)
	t.types[c.TypeURL()] = st
	t.order = append(t.order, st)
	t.cancel = append(t.cancel, cancel)
	return st
}

func (t *streamTypes[T]) close() {
	for _, c := range t.cancel {
		c()
	}
}

// ---- Delta ----

type deltaStream struct {
	s      *Server
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	types  *streamTypes[deltaType]
	node   string
	id     int64
	nonce  uint64
}

// deltaType is one type's subscription on a delta stream.
type deltaType struct {
	cache   Cache
	sub     *Subscription
	started bool
}

// DeltaAggregatedResources implements incremental ADS for the index's
// types (resource.WorkloadType, resource.AddressType).
func (s *Server) DeltaAggregatedResources(stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	st := &deltaStream{s: s, stream: stream, id: s.streams.Add(1), types: newStreamTypes[deltaType]()}
	defer st.types.close()
	recv := func() (*deltaRequest, error) {
		req := &deltaRequest{DeltaDiscoveryRequest: &discovery.DeltaDiscoveryRequest{}}
		if err := stream.RecvMsg(req); err != nil {
			return nil, err
		}
		return req, nil
	}
	return serveStream(s, stream.Context(), protoDelta, st.id, func() string { return st.node }, recv, st.types.notify,
		st.handle, func() error {
			for _, t := range st.types.order {
				if !t.started {
					continue
				}
				if err := st.flush(t, nil, false, Known{}, time.Time{}); err != nil {
					return err
				}
			}
			return nil
		})
}

func (st *deltaStream) handle(req *deltaRequest) error {
	defer req.release() // the response below is selected by then
	c := st.s.accept(&st.node, req)
	if c == nil {
		return nil
	}
	t := st.types.get(c, func(c Cache, sub *Subscription) *deltaType { return &deltaType{cache: c, sub: sub} })
	received := time.Now()
	if n := req.GetResponseNonce(); n != "" {
		if ed := req.GetErrorDetail(); ed != nil {
			st.s.nack(protoDelta, st.node, n, ed.GetMessage())
		} else {
			st.s.m.acks.WithLabelValues(protoDelta).Inc()
		}
	}
	first := !t.started
	t.started = true
	added, addedWildcard := t.sub.ApplyDelta(first, req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe())
	var known Known
	if first {
		known = req.versions()
	}
	if addedWildcard || len(added) > 0 {
		return st.flush(t, added, addedWildcard, known, received)
	}
	return nil
}

// flush sends, in one response, what the cache selects for the stream's
// type t: the pending changes it subscribes to plus the newly subscribed
// names. A new subscription always gets a response, even empty, so a
// client sees it is synced.
func (st *deltaStream) flush(t *deltaType, added []string, addedWildcard bool, known Known, since time.Time) error {
	d := t.cache.DeltaResponse(t.sub, added, addedWildcard, known)
	if since.IsZero() || (!d.Since.IsZero() && d.Since.Before(since)) {
		since = d.Since
	}
	answer := addedWildcard || len(added) > 0
	if !answer && len(d.Resources) == 0 && len(d.Removed) == 0 {
		return nil
	}
	st.nonce++
	head := &discovery.DeltaDiscoveryResponse{
		SystemVersionInfo: strconv.FormatUint(d.Revision, 10), TypeUrl: t.cache.TypeURL(),
		Nonce: strconv.FormatUint(st.nonce, 10), RemovedResources: d.Removed,
	}
	typed := func() proto.Message {
		resp := &discovery.DeltaDiscoveryResponse{
			SystemVersionInfo: head.SystemVersionInfo, TypeUrl: head.TypeUrl, Nonce: head.Nonce, RemovedResources: d.Removed,
			Resources: make([]*discovery.Resource, len(d.Resources)),
		}
		for i, r := range d.Resources {
			resp.Resources[i] = r.Delta()
		}
		return resp
	}
	parts := make([][]byte, 0, 3*len(d.Resources))
	for _, r := range d.Resources {
		parts = r.appendDelta(parts)
	}
	if err := sendEncoded(st.stream, typed, head, parts); err != nil {
		return err
	}
	st.s.m.pushed(protoDelta, len(d.Resources)+len(d.Removed), since)
	return nil
}

// ---- SotW ----

type sotwStream struct {
	s      *Server
	stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer
	types  *streamTypes[sotwType]
	node   string
	id     int64
	nonce  uint64
}

// sotwType is one type's subscription on a SotW stream.
type sotwType struct {
	cache   Cache
	sub     *Subscription
	nonce   string // of the last response of this type
	started bool
	// waiting is true between a response and the client's next request: a
	// SotW server answers requests, so updates wait for the ACK.
	waiting bool
	dirty   bool
	since   time.Time
}

// StreamAggregatedResources implements state-of-the-world ADS for the
// index's types: every response carries every subscribed resource of its
// type.
func (s *Server) StreamAggregatedResources(stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	st := &sotwStream{s: s, stream: stream, id: s.streams.Add(1), types: newStreamTypes[sotwType]()}
	defer st.types.close()
	return serveStream(s, stream.Context(), protoSotW, st.id, func() string { return st.node }, stream.Recv, st.types.notify,
		st.handle, func() error {
			for _, t := range st.types.order {
				if err := st.changed(t); err != nil {
					return err
				}
			}
			return nil
		})
}

func (st *sotwStream) handle(req *discovery.DiscoveryRequest) error {
	c := st.s.accept(&st.node, req)
	if c == nil {
		return nil
	}
	t := st.types.get(c, func(c Cache, sub *Subscription) *sotwType { return &sotwType{cache: c, sub: sub} })
	received := time.Now()
	if n := req.GetResponseNonce(); n != "" {
		if n != t.nonce {
			return nil // stale: a newer response is on its way
		}
		t.waiting = false
		if ed := req.GetErrorDetail(); ed != nil {
			st.s.nack(protoSotW, st.node, n, ed.GetMessage())
		} else {
			st.s.m.acks.WithLabelValues(protoSotW).Inc()
		}
	}
	changedSub := t.sub.SetSotW(req.GetResourceNames()) || !t.started
	t.started = true
	if changedSub {
		t.dirty, t.since = true, received
	}
	return st.changed(t)
}

// changed sends the current state of t if something the stream subscribes
// to changed and the client has answered the previous response of t.
func (st *sotwStream) changed(t *sotwType) error {
	if !t.started {
		return nil
	}
	if hit, psince := t.sub.TakeChanged(); hit {
		if !t.dirty || psince.Before(t.since) {
			t.since = psince
		}
		t.dirty = true
	}
	if !t.dirty || t.waiting {
		return nil
	}
	state := t.cache.SotWResponse(t.sub)
	st.nonce++
	t.nonce = strconv.FormatUint(st.nonce, 10)
	head := &discovery.DiscoveryResponse{
		TypeUrl:     t.cache.TypeURL(),
		VersionInfo: strconv.FormatUint(state.Revision, 10),
		Nonce:       t.nonce,
	}
	typed := func() proto.Message {
		resp := &discovery.DiscoveryResponse{
			TypeUrl: head.TypeUrl, VersionInfo: head.VersionInfo, Nonce: head.Nonce,
			Resources: make([]*anypb.Any, len(state.Resources)),
		}
		for i, r := range state.Resources {
			resp.Resources[i] = r.Any()
		}
		return resp
	}
	parts := make([][]byte, 0, 2*len(state.Resources))
	for _, r := range state.Resources {
		parts = r.appendSotW(parts)
	}
	if err := sendEncoded(st.stream, typed, head, parts); err != nil {
		return err
	}
	st.s.m.pushed(protoSotW, len(state.Resources), t.since)
	t.dirty, t.waiting, t.since = false, true, time.Time{}
	return nil
}

// sendEncoded sends the response typed builds as a preEncoded wrapper: the
// server codec writes it as head (marshalled here, small) followed by the
// pre-encoded resource parts; any other codec marshals what typed builds.
func sendEncoded(stream grpc.ServerStream, typed func() proto.Message, head proto.Message, parts [][]byte) error {
	hb, err := proto.Marshal(head)
	if err != nil {
		return fmt.Errorf("failed to marshal xds response head: %w", err)
	}
	return stream.SendMsg(&preEncoded{build: typed, parts: append([][]byte{hb}, parts...)})
}
