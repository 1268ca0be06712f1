package workload

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// wildcard is the resource name that subscribes to everything.
const wildcard = "*"

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
// SotW, for TypeURL. Requests for other types are ignored. Resources are
// never marshalled per client: every stream sends the shared, once-marshalled
// Resource entries.
type Server struct {
	idx     *Index
	log     *slog.Logger
	m       *metrics
	streams atomic.Int64

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
	idx.mu.Lock()
	idx.onSize = func(n int) { m.workloads.Set(float64(n)) }
	m.workloads.Set(float64(len(idx.byName)))
	idx.mu.Unlock()
	return &Server{idx: idx, log: log, m: m}, nil
}

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

// ListenConfig says where Serve listens.
type ListenConfig struct {
	// Socket is the unix socket path (created with mode 0600, a stale file
	// is replaced). Empty for none.
	Socket string
	// TCPAddress is an optional host:port.
	TCPAddress string
	// MaxMessageBytes bounds received messages (initial_resource_versions
	// of a large wildcard reconnect is ~90 B per workload); 0 means 256 MiB.
	MaxMessageBytes int
}

// Serve listens as lc says and serves until ctx ends, then stops gracefully.
func (s *Server) Serve(ctx context.Context, lc ListenConfig) error {
	if lc.Socket == "" && lc.TCPAddress == "" {
		return errors.New("failed to serve xds: neither a unix socket nor a TCP address is configured")
	}
	var lis []net.Listener
	closeAll := func() {
		for _, l := range lis {
			_ = l.Close()
		}
	}
	if lc.Socket != "" {
		l, err := ListenUnix(lc.Socket)
		if err != nil {
			return err
		}
		lis = append(lis, l)
	}
	if lc.TCPAddress != "" {
		l, err := net.Listen("tcp", lc.TCPAddress)
		if err != nil {
			closeAll()
			return fmt.Errorf("failed to listen on xds address %q: %w", lc.TCPAddress, err)
		}
		lis = append(lis, l)
	}
	g := grpc.NewServer(ServerGRPCOptions(lc.MaxMessageBytes)...)
	s.Register(g)
	errc := make(chan error, len(lis))
	for _, l := range lis {
		go func() { errc <- g.Serve(l) }()
	}
	select {
	case <-ctx.Done():
		stopped := make(chan struct{})
		go func() { g.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			g.Stop()
		}
		return nil
	case err := <-errc:
		g.Stop()
		return fmt.Errorf("failed to serve xds: %w", err)
	}
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

// ListenUnix listens on a unix socket at path with mode 0600, replacing a
// stale socket file.
func ListenUnix(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("failed to remove stale xds socket %q: %w", path, err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("failed to listen on xds socket %q: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("failed to set mode of xds socket %q: %w", path, err)
	}
	return l, nil
}

// recvLoop forwards requests from recv until it fails.
// serveStream is the loop of one ADS stream, Delta or SotW: client requests
// go to handle, index changes to changed, until the client leaves (nil) or
// ctx ends.
func serveStream[T any](s *Server, ctx context.Context, protocol string, id int64, node func() string,
	recv func() (T, error), w *watcher, handle func(T) error, changed func() error,
) error {
	s.m.clients.WithLabelValues(protocol).Inc()
	defer s.m.clients.WithLabelValues(protocol).Dec()
	reqs := make(chan T)
	errc := make(chan error, 1)
	go recvLoop(ctx, recv, reqs, errc)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-errc:
			s.log.Debug("xds stream closed", "protocol", protocol, "stream", id, "node", node(), "error", err)
			return nil
		case req := <-reqs:
			if err := handle(req); err != nil {
				return err
			}
		case <-w.ch:
			if err := changed(); err != nil {
				return err
			}
		}
	}
}

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

// ---- Delta ----

type deltaStream struct {
	s        *Server
	stream   discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	w        *watcher
	node     string
	id       int64
	nonce    uint64
	started  bool
	wildcard bool
	names    map[string]struct{}
}

// DeltaAggregatedResources implements incremental ADS for TypeURL.
func (s *Server) DeltaAggregatedResources(stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	st := &deltaStream{s: s, stream: stream, id: s.streams.Add(1), names: make(map[string]struct{})}
	st.w = s.idx.watch()
	defer s.idx.unwatch(st.w)
	return serveStream(s, stream.Context(), protoDelta, st.id, func() string { return st.node }, stream.Recv, st.w,
		st.handle, func() error {
			if !st.started {
				return nil
			}
			return st.flush(nil, false, nil, time.Time{})
		})
}

func (st *deltaStream) handle(req *discovery.DeltaDiscoveryRequest) error {
	if st.node == "" && req.GetNode() != nil {
		st.node = req.GetNode().GetId()
	}
	if req.GetTypeUrl() != TypeURL {
		st.s.log.Debug("ignoring xds request for an unserved type", "type_url", req.GetTypeUrl(), "node", st.node)
		return nil
	}
	received := time.Now()
	if n := req.GetResponseNonce(); n != "" {
		if ed := req.GetErrorDetail(); ed != nil {
			st.s.nack(protoDelta, st.node, n, ed.GetMessage())
		} else {
			st.s.m.acks.WithLabelValues(protoDelta).Inc()
		}
	}
	first := !st.started
	st.started = true
	var added []string
	addWildcard := false
	subs := req.GetResourceNamesSubscribe()
	if first && len(subs) == 0 {
		subs = []string{wildcard} // legacy wildcard
	}
	for _, n := range subs {
		if n == wildcard {
			if !st.wildcard {
				st.wildcard, addWildcard = true, true
			}
			continue
		}
		if _, ok := st.names[n]; !ok {
			st.names[n] = struct{}{}
			added = append(added, n)
		}
	}
	for _, n := range req.GetResourceNamesUnsubscribe() {
		if n == wildcard {
			st.wildcard = false
			continue
		}
		delete(st.names, n)
	}
	var known map[string]string
	if first {
		known = req.GetInitialResourceVersions()
	}
	if addWildcard || len(added) > 0 {
		return st.flush(added, addWildcard, known, received)
	}
	return nil
}

func (st *deltaStream) subscribed(name string) bool {
	if st.wildcard {
		return true
	}
	_, ok := st.names[name]
	return ok
}

// flush sends, in one response, the pending changes the stream subscribes to
// plus the newly subscribed names (all, for a new wildcard), skipping those
// whose version the client already has (known: initial_resource_versions).
// A first flush always responds, even empty, so a client sees it is synced.
func (st *deltaStream) flush(added []string, addWildcard bool, known map[string]string, since time.Time) error {
	x := st.s.idx
	resp := &discovery.DeltaDiscoveryResponse{TypeUrl: TypeURL}
	var parts [][]byte
	add := func(r *Resource) {
		resp.Resources = append(resp.Resources, r.Delta)
		parts = append(parts, r.wireDelta)
	}
	seen := make(map[string]struct{}, len(added))
	send := func(name string, absentIsRemoval bool) {
		if _, dup := seen[name]; dup {
			return
		}
		seen[name] = struct{}{}
		r, ok := x.byName[name]
		switch {
		case ok && known[name] != r.Version:
			add(r)
		case !ok && absentIsRemoval:
			resp.RemovedResources = append(resp.RemovedResources, name)
		}
	}
	x.mu.RLock()
	pending, psince := st.w.take()
	if since.IsZero() || (!psince.IsZero() && psince.Before(since)) {
		since = psince
	}
	if addWildcard {
		// One pass over the index; a second over the client's versions only
		// if some of them name workloads we no longer have.
		hits := 0
		for name, r := range x.byName {
			v, had := known[name]
			if had {
				hits++
				if v == r.Version {
					continue
				}
			}
			add(r)
		}
		if hits < len(known) {
			for name := range known {
				if _, ok := x.byName[name]; !ok {
					seen[name] = struct{}{}
					resp.RemovedResources = append(resp.RemovedResources, name)
				}
			}
		}
	}
	if !addWildcard {
		for _, name := range added {
			send(name, true) // absent: tell the client it does not exist
		}
	}
	known = nil // pending changes are sent whatever the client had
	for name := range pending {
		if !st.subscribed(name) {
			continue
		}
		if addWildcard {
			// The wildcard pass sent the current state; only removals are left.
			if _, ok := x.byName[name]; !ok {
				send(name, true)
			}
			continue
		}
		send(name, true)
	}
	rev := x.rev
	x.mu.RUnlock()
	answer := addWildcard || len(added) > 0
	if !answer && len(resp.Resources) == 0 && len(resp.RemovedResources) == 0 {
		return nil
	}
	st.nonce++
	resp.Nonce = strconv.FormatUint(st.nonce, 10)
	resp.SystemVersionInfo = strconv.FormatUint(rev, 10)
	if err := sendEncoded(st.stream.Send, resp, &discovery.DeltaDiscoveryResponse{
		SystemVersionInfo: resp.SystemVersionInfo, TypeUrl: resp.TypeUrl, Nonce: resp.Nonce, RemovedResources: resp.RemovedResources,
	}, parts); err != nil {
		return err
	}
	st.s.m.pushed(protoDelta, len(resp.Resources)+len(resp.RemovedResources), since)
	return nil
}

// ---- SotW ----

type sotwStream struct {
	s       *Server
	stream  discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer
	w       *watcher
	node    string
	id      int64
	nonce   uint64
	started bool
	// waiting is true between a response and the client's next request: a
	// SotW server answers requests, so updates wait for the ACK.
	waiting  bool
	dirty    bool
	since    time.Time
	wildcard bool
	names    map[string]struct{}
}

// StreamAggregatedResources implements state-of-the-world ADS for TypeURL:
// every response carries every subscribed workload.
func (s *Server) StreamAggregatedResources(stream discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	st := &sotwStream{s: s, stream: stream, id: s.streams.Add(1)}
	st.w = s.idx.watch()
	defer s.idx.unwatch(st.w)
	return serveStream(s, stream.Context(), protoSotW, st.id, func() string { return st.node }, stream.Recv, st.w,
		st.handle, st.changed)
}

func (st *sotwStream) handle(req *discovery.DiscoveryRequest) error {
	if st.node == "" && req.GetNode() != nil {
		st.node = req.GetNode().GetId()
	}
	if req.GetTypeUrl() != TypeURL {
		st.s.log.Debug("ignoring xds request for an unserved type", "type_url", req.GetTypeUrl(), "node", st.node)
		return nil
	}
	received := time.Now()
	if n := req.GetResponseNonce(); n != "" {
		if n != strconv.FormatUint(st.nonce, 10) {
			return nil // stale: a newer response is on its way
		}
		st.waiting = false
		if ed := req.GetErrorDetail(); ed != nil {
			st.s.nack(protoSotW, st.node, n, ed.GetMessage())
		} else {
			st.s.m.acks.WithLabelValues(protoSotW).Inc()
		}
	}
	wild, names := false, make(map[string]struct{}, len(req.GetResourceNames()))
	for _, n := range req.GetResourceNames() {
		if n == wildcard {
			wild = true
		} else {
			names[n] = struct{}{}
		}
	}
	if len(names) == 0 {
		wild = true
	}
	changedSub := !st.started || wild != st.wildcard || !sameSet(names, st.names)
	st.started, st.wildcard, st.names = true, wild, names
	if changedSub {
		st.dirty, st.since = true, received
	}
	return st.changed()
}

// changed sends the current state if something the stream subscribes to
// changed and the client has answered the previous response.
func (st *sotwStream) changed() error {
	if !st.started {
		return nil
	}
	pending, psince := st.w.take()
	for name := range pending {
		if st.subscribed(name) {
			if !st.dirty || psince.Before(st.since) {
				st.since = psince
			}
			st.dirty = true
			break
		}
	}
	if !st.dirty || st.waiting {
		return nil
	}
	var rev uint64
	var list []*Resource
	if st.wildcard {
		rev, list = st.s.idx.sotwAll()
	} else {
		x := st.s.idx
		x.mu.RLock()
		rev = x.rev
		for name := range st.names {
			if r, ok := x.byName[name]; ok {
				list = append(list, r)
			}
		}
		x.mu.RUnlock()
	}
	st.nonce++
	head := &discovery.DiscoveryResponse{
		TypeUrl:     TypeURL,
		VersionInfo: strconv.FormatUint(rev, 10),
		Nonce:       strconv.FormatUint(st.nonce, 10),
	}
	resp := &discovery.DiscoveryResponse{
		TypeUrl: head.TypeUrl, VersionInfo: head.VersionInfo, Nonce: head.Nonce,
		Resources: make([]*anypb.Any, len(list)),
	}
	parts := make([][]byte, len(list))
	for i, r := range list {
		resp.Resources[i], parts[i] = r.Any, r.wireSotW
	}
	if err := sendEncoded(st.stream.Send, resp, head, parts); err != nil {
		return err
	}
	st.s.m.pushed(protoSotW, len(list), st.since)
	st.dirty, st.waiting, st.since = false, true, time.Time{}
	return nil
}

func (st *sotwStream) subscribed(name string) bool {
	if st.wildcard {
		return true
	}
	_, ok := st.names[name]
	return ok
}

// sendEncoded sends msg; with the server codec installed it goes out as
// head (marshalled here, small) followed by the pre-encoded resource parts.
func sendEncoded[M proto.Message](send func(M) error, msg M, head proto.Message, parts [][]byte) error {
	hb, err := proto.Marshal(head)
	if err != nil {
		return fmt.Errorf("failed to marshal xds response head: %w", err)
	}
	encodedParts.Store(msg, append([][]byte{hb}, parts...))
	defer encodedParts.Delete(msg)
	return send(msg)
}

func sameSet(a, b map[string]struct{}) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if _, ok := b[k]; !ok {
			return false
		}
	}
	return true
}
