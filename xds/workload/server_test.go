package workload

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	sotwclient "github.com/envoyproxy/go-control-plane/pkg/client/sotw/v3"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/registry"
	"aether.io/node/xds/resource"
)

// testServer is a Server on a unix socket in a temp dir.
type testServer struct {
	idx    *Index
	srv    *Server
	reg    *prometheus.Registry
	socket string
}

func startServer(t *testing.T, idx *Index) *testServer {
	t.Helper()
	return startServerWith(t, idx, ServerGRPCOptions(0))
}

// startServerWith serves with the given grpc options: ServerGRPCOptions (our
// codec) or none (the stock proto codec; the fallback path).
func startServerWith(t *testing.T, idx *Index, opts []grpc.ServerOption) *testServer {
	t.Helper()
	reg := prometheus.NewRegistry()
	srv, err := NewServer(idx, ServerOptions{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(t.TempDir(), "run", "xds.sock")
	lis, err := unixsock.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(opts...)
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return &testServer{idx: idx, srv: srv, reg: reg, socket: socket}
}

func dialTest(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30), grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func endpointN(i int) registry.Endpoint {
	ep := testEndpoint()
	ep.Key = fmt.Sprintf("sandbox-%d", i)
	ep.Name = fmt.Sprintf("web-7d9f8c6b5-%05d", i)
	ep.IPs = []netip.Addr{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})}
	return ep
}

func fill(t testing.TB, x *Index, n int) {
	t.Helper()
	for i := range n {
		ep := endpointN(i)
		w, err := Build(testConfig, ep)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
	}
}

// wire is a decoded message: field number → raw values (bytes for length
// delimited fields, varints for the rest), decoded with protowire only, so
// the check does not depend on our generated code.
type wire map[protowire.Number][]any

func parseWire(t *testing.T, b []byte) wire {
	t.Helper()
	out := wire{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		switch typ {
		case protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				t.Fatalf("bad bytes field %d", num)
			}
			out[num] = append(out[num], v)
			b = b[n:]
		case protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				t.Fatalf("bad varint field %d", num)
			}
			out[num] = append(out[num], v)
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				t.Fatalf("bad field %d", num)
			}
			b = b[n:]
		}
	}
	return out
}

func (w wire) str(n protowire.Number) string {
	if len(w[n]) != 1 {
		return ""
	}
	return string(w[n][0].([]byte))
}

func (w wire) varint(n protowire.Number) uint64 {
	if len(w[n]) != 1 {
		return 0
	}
	return w[n][0].(uint64)
}

// checkZtunnelFields checks a Workload encoding against the field numbers of
// ztunnel's workload.proto and the endpoint it came from.
func checkZtunnelFields(t *testing.T, body []byte, ep registry.Endpoint) {
	t.Helper()
	w := parseWire(t, body)
	wantUID := "Kubernetes//Pod/" + ep.Namespace + "/" + ep.Name
	checks := []struct {
		field protowire.Number
		what  string
		got   any
		want  any
	}{
		{20, "uid", w.str(20), wantUID},
		{1, "name", w.str(1), ep.Name},
		{2, "namespace", w.str(2), ep.Namespace},
		{9, "node", w.str(9), ep.Node},
		{7, "service_account", w.str(7), ep.ServiceAccount},
		{13, "workload_name", w.str(13), "web"},
		{10, "canonical_name", w.str(10), "web"},
		{18, "cluster_id", w.str(18), "Kubernetes"},
		{12, "workload_type (DEPLOYMENT=0, omitted)", len(w[12]), 0},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("field %d (%s) = %v, want %v", c.field, c.what, c.got, c.want)
		}
	}
	wantStatus := uint64(0)
	if !ep.Healthy {
		wantStatus = 1
	}
	if got := w.varint(17); got != wantStatus {
		t.Errorf("field 17 (status) = %d, want %d", got, wantStatus)
	}
	wantMode := uint64(0)
	if ep.HostNetwork {
		wantMode = 1
	}
	if got := w.varint(25); got != wantMode {
		t.Errorf("field 25 (network_mode) = %d, want %d", got, wantMode)
	}
	var addrs []netip.Addr
	for _, v := range w[3] {
		a, ok := netip.AddrFromSlice(v.([]byte))
		if !ok || (len(v.([]byte)) != 4 && len(v.([]byte)) != 16) {
			t.Errorf("field 3 (addresses) holds %x, not raw 4/16-byte IP", v)
		}
		addrs = append(addrs, a)
	}
	if !slices.Equal(addrs, ep.IPs) {
		t.Errorf("field 3 (addresses) = %v, want %v", addrs, ep.IPs)
	}
	if len(w[24]) != 1 {
		t.Fatalf("field 24 (locality) missing")
	}
	loc := parseWire(t, w[24][0].([]byte))
	if loc.str(1) != ep.Locality.Region || loc.str(2) != ep.Locality.Zone {
		t.Errorf("locality = %q/%q, want %q/%q", loc.str(1), loc.str(2), ep.Locality.Region, ep.Locality.Zone)
	}
}

// codecs runs a test against both encodings of the server's responses.
var codecs = map[string][]grpc.ServerOption{"codec": ServerGRPCOptions(0), "stock": nil}

func TestSotWWithGoControlPlaneClient(t *testing.T) {
	for name, opts := range codecs {
		t.Run(name, func(t *testing.T) { testSotW(t, opts) })
	}
}

func testSotW(t *testing.T, opts []grpc.ServerOption) {
	x := NewIndex()
	fill(t, x, 3)
	ts := startServerWith(t, x, opts)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := sotwclient.NewADSClient(ctx, &core.Node{Id: "gcp-sotw"}, resource.WorkloadType)
	if err := c.InitConnect(dialTest(t, ts.socket)); err != nil {
		t.Fatal(err)
	}
	byName := func(resp *sotwclient.Response) map[string][]byte {
		out := map[string][]byte{}
		for _, a := range resp.Resources {
			if a.GetTypeUrl() != resource.WorkloadType {
				t.Errorf("resource type %q, want %q", a.GetTypeUrl(), resource.WorkloadType)
			}
			w := parseWire(t, a.GetValue())
			out[w.str(20)] = a.GetValue()
		}
		return out
	}
	resp, err := c.Fetch()
	if err != nil {
		t.Fatal(err)
	}
	got := byName(resp)
	if len(got) != 3 {
		t.Fatalf("initial SotW response has %d workloads, want 3", len(got))
	}
	for i := range 3 {
		ep := endpointN(i)
		body, ok := got[UID("Kubernetes", ep.Namespace, ep.Name)]
		if !ok {
			t.Fatalf("workload %s missing", ep.Name)
		}
		checkZtunnelFields(t, body, ep)
	}
	if err := c.Ack(); err != nil {
		t.Fatal(err)
	}

	// A change is pushed as the whole state; a removal drops out of it.
	ep := endpointN(1)
	ep.Healthy = false
	w, _ := Build(testConfig, ep)
	if _, err := x.Upsert(ep.Key, w); err != nil {
		t.Fatal(err)
	}
	resp, err = c.Fetch()
	if err != nil {
		t.Fatal(err)
	}
	got = byName(resp)
	if len(got) != 3 {
		t.Fatalf("SotW update has %d workloads, want 3", len(got))
	}
	checkZtunnelFields(t, got[w.GetUid()], ep)
	if err := c.Ack(); err != nil {
		t.Fatal(err)
	}
	x.Remove(endpointN(0).Key)
	resp, err = c.Fetch()
	if err != nil {
		t.Fatal(err)
	}
	if got = byName(resp); len(got) != 2 {
		t.Fatalf("SotW after removal has %d workloads, want 2", len(got))
	}
	if _, ok := got[UID("Kubernetes", "shop", endpointN(0).Name)]; ok {
		t.Fatal("removed workload still in SotW state")
	}

	// A NACK is counted and visible.
	if err := c.Nack("bad workload"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return ts.srv.LastNACK() != nil })
	if n := ts.srv.LastNACK(); n.Message != "bad workload" || n.Node != "gcp-sotw" || n.Protocol != "sotw" {
		t.Errorf("LastNACK = %+v", n)
	}
	if v := metricValue(t, ts.srv.m.nacks.WithLabelValues("sotw")); v != 1 {
		t.Errorf("nacks metric = %v, want 1", v)
	}
	if v := metricValue(t, ts.srv.m.lastNACK.WithLabelValues("sotw", "gcp-sotw", "bad workload")); v == 0 {
		t.Error("last NACK gauge not set")
	}
	if v := metricValue(t, ts.srv.m.clients.WithLabelValues("sotw")); v != 1 {
		t.Errorf("connected sotw clients = %v, want 1", v)
	}
}

// waitFor polls cond with a generous bound; it never asserts on time.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached within 60s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// deltaStream opens a raw delta ADS stream with go-control-plane's generated
// client, the way any third-party client would.
type rawDelta struct {
	t *testing.T
	s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
}

func openDelta(t *testing.T, socket string, first *discovery.DeltaDiscoveryRequest) *rawDelta {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := discovery.NewAggregatedDiscoveryServiceClient(dialTest(t, socket)).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	first.TypeUrl = resource.WorkloadType
	first.Node = &core.Node{Id: "gcp-delta"}
	// io.EOF: the server already ended the stream (a stopped server does so
	// at once); its status is what the next Recv returns, as grpc documents.
	if err := s.Send(first); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	return &rawDelta{t: t, s: s}
}

// recv receives one response and ACKs it.
func (d *rawDelta) recv() *discovery.DeltaDiscoveryResponse {
	d.t.Helper()
	resp, err := d.s.Recv()
	if err != nil {
		d.t.Fatal(err)
	}
	if resp.GetTypeUrl() != resource.WorkloadType {
		d.t.Fatalf("response type %q", resp.GetTypeUrl())
	}
	if err := d.s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.WorkloadType, ResponseNonce: resp.GetNonce()}); err != nil {
		d.t.Fatal(err)
	}
	return resp
}

func names(resp *discovery.DeltaDiscoveryResponse) []string {
	var out []string
	for _, r := range resp.GetResources() {
		out = append(out, r.GetName())
	}
	slices.Sort(out)
	return out
}

func TestDeltaWildcardConformance(t *testing.T) {
	for name, opts := range codecs {
		t.Run(name, func(t *testing.T) { testDeltaWildcard(t, opts) })
	}
}

func testDeltaWildcard(t *testing.T, opts []grpc.ServerOption) {
	x := NewIndex()
	fill(t, x, 5)
	ts := startServerWith(t, x, opts)
	d := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{"*"}})
	resp := d.recv()
	if len(resp.GetResources()) != 5 || len(resp.GetRemovedResources()) != 0 {
		t.Fatalf("initial delta: %d resources, %d removed; want 5, 0", len(resp.GetResources()), len(resp.GetRemovedResources()))
	}
	for _, r := range resp.GetResources() {
		body := r.GetResource().GetValue()
		w := parseWire(t, body)
		if w.str(20) != r.GetName() {
			t.Errorf("resource name %q != uid %q", r.GetName(), w.str(20))
		}
		if r.GetVersion() == "" {
			t.Errorf("resource %q has no version", r.GetName())
		}
		var ep registry.Endpoint
		for i := range 5 {
			if e := endpointN(i); UID("Kubernetes", e.Namespace, e.Name) == r.GetName() {
				ep = e
			}
		}
		checkZtunnelFields(t, body, ep)
	}
	// Unhealthy → status UNHEALTHY; removal → removed_resources.
	ep := endpointN(2)
	ep.Healthy = false
	ep.HostNetwork = true
	w, _ := Build(testConfig, ep)
	if _, err := x.Upsert(ep.Key, w); err != nil {
		t.Fatal(err)
	}
	resp = d.recv()
	if got := names(resp); !slices.Equal(got, []string{w.GetUid()}) {
		t.Fatalf("update pushed %v, want only %s", got, w.GetUid())
	}
	checkZtunnelFields(t, resp.GetResources()[0].GetResource().GetValue(), ep)
	x.Remove(endpointN(3).Key)
	resp = d.recv()
	if len(resp.GetResources()) != 0 || !slices.Equal(resp.GetRemovedResources(), []string{UID("Kubernetes", "shop", endpointN(3).Name)}) {
		t.Fatalf("removal pushed %v / removed %v", names(resp), resp.GetRemovedResources())
	}
	if v := metricValue(t, ts.srv.m.clients.WithLabelValues("delta")); v != 1 {
		t.Errorf("connected delta clients = %v, want 1", v)
	}
	// A push is counted once it is sent, which can be after the client
	// read it: wait for the third, then check there was no other.
	pushes := ts.srv.m.pushes.WithLabelValues("delta")
	waitFor(t, func() bool { return metricValue(t, pushes) >= 3 })
	if v := metricValue(t, pushes); v != 3 {
		t.Errorf("delta pushes = %v, want 3", v)
	}
}

func TestDeltaReconnectSendsOnlyTheDifference(t *testing.T) {
	x := NewIndex()
	fill(t, x, 100)
	ts := startServer(t, x)
	d := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{})
	versions := map[string]string{}
	for _, r := range d.recv().GetResources() {
		versions[r.GetName()] = r.GetVersion()
	}
	if len(versions) != 100 {
		t.Fatalf("initial push had %d workloads, want 100", len(versions))
	}
	// While the client is away: 2 change, 1 goes, 1 comes.
	var changed []string
	for _, i := range []int{10, 20} {
		ep := endpointN(i)
		ep.Healthy = false
		w, _ := Build(testConfig, ep)
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
		changed = append(changed, w.GetUid())
	}
	x.Remove(endpointN(30).Key)
	fill2 := endpointN(100)
	w, _ := Build(testConfig, fill2)
	if _, err := x.Upsert(fill2.Key, w); err != nil {
		t.Fatal(err)
	}
	changed = append(changed, w.GetUid())
	slices.Sort(changed)

	d2 := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: versions})
	resp := d2.recv()
	if got := names(resp); !slices.Equal(got, changed) {
		t.Errorf("reconnect sent %v, want %v", got, changed)
	}
	if want := []string{UID("Kubernetes", "shop", endpointN(30).Name)}; !slices.Equal(resp.GetRemovedResources(), want) {
		t.Errorf("reconnect removed %v, want %v", resp.GetRemovedResources(), want)
	}
	// Nothing changed: the reconnect answer is empty.
	d3 := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{InitialResourceVersions: currentVersions(x)})
	if resp := d3.recv(); len(resp.GetResources())+len(resp.GetRemovedResources()) != 0 {
		t.Errorf("reconnect with current versions got %d resources, %d removed", len(resp.GetResources()), len(resp.GetRemovedResources()))
	}
}

func currentVersions(x *Index) map[string]string {
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := map[string]string{}
	for _, r := range x.allLocked() {
		out[r.Name] = r.Version
	}
	return out
}

func TestDeltaNamedSubscriptions(t *testing.T) {
	x := NewIndex()
	fill(t, x, 3)
	ts := startServer(t, x)
	uid := func(i int) string { return UID("Kubernetes", "shop", endpointN(i).Name) }
	missing := UID("Kubernetes", "shop", "nope")
	d := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{uid(0), missing}})
	resp := d.recv()
	if !slices.Equal(names(resp), []string{uid(0)}) || !slices.Equal(resp.GetRemovedResources(), []string{missing}) {
		t.Fatalf("named subscription got %v, removed %v", names(resp), resp.GetRemovedResources())
	}
	bump := func(i int) {
		ep := endpointN(i)
		ep.ServiceAccount = fmt.Sprintf("sa-%d", time.Now().UnixNano())
		w, _ := Build(testConfig, ep)
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
	}
	// A change to an unsubscribed workload is not sent: the next response
	// carries only the subscribed one.
	bump(1)
	bump(0)
	if got := names(d.recv()); !slices.Equal(got, []string{uid(0)}) {
		t.Fatalf("got %v, want only %s", got, uid(0))
	}
	// Subscribe to 2 later; unsubscribe 0.
	if err := d.s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.WorkloadType, ResourceNamesSubscribe: []string{uid(2)}, ResourceNamesUnsubscribe: []string{uid(0)}}); err != nil {
		t.Fatal(err)
	}
	if got := names(d.recv()); !slices.Equal(got, []string{uid(2)}) {
		t.Fatalf("late subscription got %v", got)
	}
	bump(0)
	bump(2)
	if got := names(d.recv()); !slices.Equal(got, []string{uid(2)}) {
		t.Fatalf("after unsubscribe got %v, want only %s", got, uid(2))
	}
	// NACK through the delta stream.
	if err := d.s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.WorkloadType, ResponseNonce: "3", ErrorDetail: &status.Status{Message: "nope"}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return ts.srv.LastNACK() != nil })
	if n := ts.srv.LastNACK(); n.Protocol != "delta" || n.Message != "nope" || n.Node != "gcp-delta" {
		t.Errorf("LastNACK = %+v", n)
	}
}

// fakeRegistry is an in-memory registry.Registry for follower tests.
type fakeRegistry struct {
	events chan registry.Event
	eps    map[string]registry.Endpoint
}

func (f *fakeRegistry) Register(_ context.Context, ep registry.Endpoint) error {
	f.eps[ep.Key] = ep
	f.events <- registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep}
	return nil
}

func (f *fakeRegistry) Deregister(_ context.Context, key string) error {
	delete(f.eps, key)
	f.events <- registry.Event{Type: registry.EventDelete, Key: key}
	return nil
}

func (*fakeRegistry) Withdraw(string) {} // it writes nothing on its own

func (f *fakeRegistry) List(context.Context) ([]registry.Endpoint, error) { return nil, nil }

func (f *fakeRegistry) Watch(context.Context) (<-chan registry.Event, error) { return f.events, nil }

func TestFollowerLifecycle(t *testing.T) {
	x := NewIndex()
	ts := startServer(t, x)
	reg := &fakeRegistry{events: make(chan registry.Event, 16), eps: map[string]registry.Endpoint{}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := NewFollower(reg, testConfig, x, nil)
	go func() { _ = f.Run(ctx) }()
	<-f.Synced()
	d := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: []string{"*"}})
	if resp := d.recv(); len(resp.GetResources()) != 0 {
		t.Fatalf("empty registry served %d workloads", len(resp.GetResources()))
	}
	ep := endpointN(7)
	if err := reg.Register(ctx, ep); err != nil {
		t.Fatal(err)
	}
	resp := d.recv()
	if len(resp.GetResources()) != 1 {
		t.Fatalf("registration pushed %d workloads", len(resp.GetResources()))
	}
	checkZtunnelFields(t, resp.GetResources()[0].GetResource().GetValue(), ep)
	ep.Healthy = false // terminating / not live
	if err := reg.Register(ctx, ep); err != nil {
		t.Fatal(err)
	}
	resp = d.recv()
	if w := parseWire(t, resp.GetResources()[0].GetResource().GetValue()); w.varint(17) != uint64(workloadpb.WorkloadStatus_UNHEALTHY) {
		t.Errorf("status = %d, want UNHEALTHY", w.varint(17))
	}
	// An endpoint that cannot form a workload is not served (and replaces
	// nothing); the next valid change still flows.
	bad := endpointN(8)
	bad.IPs = nil
	if err := reg.Register(ctx, bad); err != nil {
		t.Fatal(err)
	}
	if err := reg.Deregister(ctx, ep.Key); err != nil {
		t.Fatal(err)
	}
	resp = d.recv()
	if !slices.Equal(resp.GetRemovedResources(), []string{UID("Kubernetes", ep.Namespace, ep.Name)}) || len(resp.GetResources()) != 0 {
		t.Fatalf("deregistration pushed %v, removed %v", names(resp), resp.GetRemovedResources())
	}
}

// metricValue reads a gauge or counter.
func metricValue(t *testing.T, c prometheus.Metric) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	}
	t.Fatalf("metric %v is neither a counter nor a gauge", c.Desc())
	return 0
}
