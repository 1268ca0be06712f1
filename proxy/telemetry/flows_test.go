package telemetry_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

// drain takes every message s holds now, without waiting.
func drain(t *testing.T, s *telemetry.Subscription) []flowapi.Message {
	t.Helper()
	var out []flowapi.Message
	for s.Pending() {
		m, err := s.Next(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

func subscribe(t *testing.T, m *telemetry.Metrics, req flowapi.Request) *telemetry.Subscription {
	t.Helper()
	s, err := m.Flows().Subscribe(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// TestFlowsNoSubscriber: without a subscriber nothing is kept (a later
// subscriber starts empty) and a connection's telemetry allocates only its
// Conn (a refusal too: two here), as with a subscriber whose filter it does
// not match.
func TestFlowsNoSubscriber(t *testing.T) {
	m := telemetry.New()
	ci := info(telemetry.ReporterSource, true)
	conn := func() {
		c := m.Open(ci)
		c.Received(10)
		c.Close(telemetry.ReasonClientClosed, nil)
		m.Refused(ci, telemetry.ReasonDenied, nil)
		m.Misdirected(ci, nil)
	}
	conn()
	if a := testing.AllocsPerRun(100, conn); a > 2 {
		t.Errorf("a connection, a refusal and a misdirected one allocate %v times without a subscriber, want only their two Conns", a)
	}
	s := subscribe(t, m, flowapi.Request{Namespace: "elsewhere"})
	if a := testing.AllocsPerRun(100, conn); a > 2 {
		t.Errorf("%v allocations with a subscriber that filters them out, want only the two Conns", a)
	}
	if s.Pending() {
		t.Errorf("the subscriber holds %v", drain(t, s))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Next(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Next on an empty queue = %v, want the context's end", err)
	}
}

// TestFlowsEvents: a connection's open and close, a refusal (its close
// only), a close a policy caused after the open, and a misdirected
// connection, as the subscriber receives them: each event is exactly the
// access log's line for the same connection.
func TestFlowsEvents(t *testing.T) {
	m, buf := bufferedMetrics(t, telemetry.AccessLogAll, 1, true)
	s := subscribe(t, m, flowapi.Request{})
	cleanAndRefused(m)
	d := m.Open(info(telemetry.ReporterDestination, true))
	d.Deny("b/deny-now", "denied_by_policy")
	d.Close(telemetry.ReasonDenied, nil)
	m.Misdirected(telemetry.ConnInfo{Reporter: telemetry.ReporterDestination, Destination: db}, errors.New("loop"))
	m.FlushAccessLog()

	got := drain(t, s)
	var types []string
	for _, msg := range got {
		types = append(types, msg.Type)
	}
	// The refusal's open line is in the access log (-access-log-open), not
	// in the flows.
	if want := []string{"opened", "closed", "closed", "opened", "closed", "closed"}; !slices.Equal(types, want) {
		t.Fatalf("message types %v, want %v", types, want)
	}
	var lines []flowapi.Event
	for l := range strings.SplitSeq(strings.TrimSpace(buf.String()), "\n") {
		var ev flowapi.Event
		if err := json.Unmarshal([]byte(l), &ev); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, ev)
	}
	lines = slices.Delete(lines, 2, 3) // the refusal's open line
	if len(lines) != len(got) {
		t.Fatalf("%d access-log lines for %d events", len(lines), len(got))
	}
	for i, msg := range got {
		if *msg.Event != lines[i] {
			t.Errorf("event %d differs from its access-log line:\n event %+v\n  line %+v", i, *msg.Event, lines[i])
		}
	}
	// Their fields but the times, which the test does not fix.
	plain := flowapi.Event{
		Reporter: "destination", SrcAddr: "10.0.0.5:40000", SrcWorkload: "web", SrcPod: "web-7c9f-x2", SrcNamespace: "a",
		DstAddr: "10.0.0.6:5432", DstWorkload: "db", DstPod: "db-0", DstNamespace: "b", DstService: "db.b.svc.cluster.local",
		Path: "plaintext", Security: "none", PolicyDecision: "none",
	}
	mtls := plain
	mtls.Path, mtls.Security, mtls.SrcPrincipal, mtls.DstPrincipal = "hbone", "mutual_tls", web.Identity, db.Identity
	want := make([]flowapi.Event, 6)
	want[0] = mtls
	want[0].Reporter = "source"
	want[1] = want[0]
	want[1].BytesToDst, want[1].BytesToSrc, want[1].Reason, want[1].ResponseFlags = 100, 7, "server_closed", "-"
	want[2] = plain
	want[2].Policy, want[2].PolicyDecision, want[2].Reason, want[2].ResponseFlags, want[2].Error = "inbound-policy/strict", "deny", "denied", "DENY", "plaintext refused"
	want[3] = mtls
	want[4] = mtls
	want[4].Policy, want[4].PolicyReason, want[4].PolicyDecision, want[4].Reason, want[4].ResponseFlags = "b/deny-now", "denied_by_policy", "deny", "denied", "DENY"
	want[5] = flowapi.Event{
		Reporter: "destination", DstWorkload: "db", DstPod: "db-0", DstNamespace: "b", Security: "none", PolicyDecision: "none",
		Reason: "misdirected", ResponseFlags: "-", Error: "loop",
	}
	for i, msg := range got {
		ev := *msg.Event
		if ev.StartTime == "" || (msg.Type == flowapi.TypeOpened) != (ev.EndTime == "") {
			t.Errorf("event %d (%s): start_time %q, end_time %q", i, msg.Type, ev.StartTime, ev.EndTime)
		}
		ev.StartTime, ev.EndTime, ev.DurationMS = "", "", 0
		if ev != want[i] {
			t.Errorf("event %d (%s):\n got %+v\nwant %+v", i, msg.Type, ev, want[i])
		}
	}
}

// TestFlowsFilters: each filter keeps the events it names, before they
// are queued.
func TestFlowsFilters(t *testing.T) {
	other := peers.Peer{Workload: "cache", Name: "cache-0", Namespace: "c"}
	conns := map[string]func(m *telemetry.Metrics){
		"web→db source": func(m *telemetry.Metrics) {
			m.Open(info(telemetry.ReporterSource, true)).Close(telemetry.ReasonClientClosed, nil)
		},
		"web→db destination denied": func(m *telemetry.Metrics) {
			m.Refused(info(telemetry.ReporterDestination, true), telemetry.ReasonDenied, nil)
		},
		"web→cache no service": func(m *telemetry.Metrics) {
			ci := info(telemetry.ReporterSource, false)
			ci.Destination, ci.Service = other, peers.ServiceRef{}
			m.Refused(ci, telemetry.ReasonConnectFailed, nil)
		},
		"cache→db deny decision": func(m *telemetry.Metrics) {
			ci := info(telemetry.ReporterDestination, false)
			ci.Source, ci.PolicyDecision, ci.Policy = other, telemetry.PolicyDeny, "b/no-cache"
			m.Refused(ci, telemetry.ReasonReset, nil)
		},
	}
	for _, tc := range []struct {
		name string
		req  flowapi.Request
		n    int // events that pass (the first connection has two)
	}{
		{"no filter", flowapi.Request{}, 5},
		{"pod at the source end", flowapi.Request{Pod: "a/web-7c9f-x2"}, 4},
		{"pod at the destination end", flowapi.Request{Pod: "c/cache-0"}, 2},
		{"pod of another namespace", flowapi.Request{Pod: "b/web-7c9f-x2"}, 0},
		{"namespace at either end", flowapi.Request{Namespace: "b"}, 4},
		{"denied: reason or decision, never an open", flowapi.Request{Denied: true}, 2},
		{"service hostname", flowapi.Request{Service: "db.b.svc.cluster.local"}, 4},
		{"service namespace/name", flowapi.Request{Service: "b/db"}, 4},
		{"service of another namespace", flowapi.Request{Service: "a/db"}, 0},
		{"reporter", flowapi.Request{Reporter: "destination"}, 2},
		{"all together", flowapi.Request{Pod: "a/web-7c9f-x2", Namespace: "b", Denied: true, Service: "b/db", Reporter: "destination"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := telemetry.New()
			s := subscribe(t, m, tc.req)
			for _, conn := range conns {
				conn(m)
			}
			if got := drain(t, s); len(got) != tc.n {
				var desc []string
				for _, g := range got {
					desc = append(desc, g.Type+":"+g.SrcPod+"→"+g.DstPod+":"+g.Reason)
				}
				t.Errorf("%d events, want %d: %v", len(got), tc.n, desc)
			}
		})
	}
}

// TestFlowsDrops: a subscriber that never reads loses what its full queue
// cannot take, counted in the metric and told in-band, at no allocation;
// another subscriber reading along loses nothing.
func TestFlowsDrops(t *testing.T) {
	m := telemetry.New()
	slow := subscribe(t, m, flowapi.Request{})
	fast := subscribe(t, m, flowapi.Request{})
	const extra = 10
	ci := info(telemetry.ReporterSource, false)
	var fastEvents int
	for range telemetry.FlowQueue + extra {
		m.Refused(ci, telemetry.ReasonConnectFailed, nil)
		for _, msg := range drain(t, fast) {
			if msg.Type != flowapi.TypeClosed {
				t.Fatalf("fast subscriber got %+v", msg)
			}
			fastEvents++
		}
	}
	if fastEvents != telemetry.FlowQueue+extra {
		t.Errorf("fast subscriber got %d events, want %d", fastEvents, telemetry.FlowQueue+extra)
	}
	// With only the full queue left, an event is dropped before anything
	// is allocated for it (AllocsPerRun runs 1 + 100 times).
	fast.Close()
	if a := testing.AllocsPerRun(100, func() { m.Refused(ci, telemetry.ReasonConnectFailed, nil) }); a > 1 {
		t.Errorf("a refusal allocates %v times with a full queue, want only its Conn", a)
	}
	const lost = extra + 101
	if got := gather(t, m, false)["aether_proxy_flow_events_dropped_total"]; got != lost {
		t.Errorf("aether_proxy_flow_events_dropped_total = %v, want %d", got, lost)
	}
	var events int
	var dropped uint64
	for _, msg := range drain(t, slow) {
		switch msg.Type {
		case flowapi.TypeClosed:
			events++
		case flowapi.TypeDropped:
			dropped += msg.Dropped
		default:
			t.Fatalf("slow subscriber got %+v", msg)
		}
	}
	if events != telemetry.FlowQueue || dropped != lost {
		t.Errorf("slow subscriber: %d events and %d told dropped, want %d and %d", events, dropped, telemetry.FlowQueue, lost)
	}
}

// TestFlowsSubscribers: at most MaxFlowSubscribers at once, counted in the
// gauge; a closed subscription ends its Next and frees its place; an
// invalid request is refused.
func TestFlowsSubscribers(t *testing.T) {
	m := telemetry.New()
	f := m.Flows()
	var subs []*telemetry.Subscription
	for range telemetry.MaxFlowSubscribers {
		subs = append(subs, subscribe(t, m, flowapi.Request{}))
	}
	if _, err := f.Subscribe(flowapi.Request{}); !errors.Is(err, telemetry.ErrTooManySubscribers) {
		t.Errorf("one more subscriber: %v, want ErrTooManySubscribers", err)
	}
	if got := gather(t, m, false)["aether_proxy_flow_subscribers"]; got != telemetry.MaxFlowSubscribers {
		t.Errorf("aether_proxy_flow_subscribers = %v, want %d", got, telemetry.MaxFlowSubscribers)
	}
	subs[0].Close()
	if _, err := subs[0].Next(context.Background()); !errors.Is(err, telemetry.ErrSubscriptionClosed) {
		t.Errorf("Next after Close = %v, want ErrSubscriptionClosed", err)
	}
	subscribe(t, m, flowapi.Request{})
	for _, s := range subs {
		s.Close()
	}
	if got := f.Subscribers(); got != 1 {
		t.Errorf("%d subscribers, want the one left", got)
	}
	if _, err := f.Subscribe(flowapi.Request{Pod: "web"}); err == nil || !strings.Contains(err.Error(), `invalid pod "web"`) {
		t.Errorf("Subscribe(invalid pod) = %v", err)
	}
}

// TestFlowsConcurrent: connections on several goroutines while other
// subscribers come and go: a subscriber that stays is given or told of
// every event (received + told dropped = published).
func TestFlowsConcurrent(t *testing.T) {
	m := telemetry.New()
	f := m.Flows()
	s := subscribe(t, m, flowapi.Request{})
	const workers, each = 4, 2000
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var received, told uint64
	read := make(chan struct{})
	go func() {
		defer close(read)
		for {
			msg, err := s.Next(ctx)
			if err != nil {
				return
			}
			if msg.Type == flowapi.TypeDropped {
				told += msg.Dropped
			} else {
				received++
			}
		}
	}()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			ci := info(telemetry.ReporterSource, true)
			for range each {
				m.Open(ci).Close(telemetry.ReasonClientClosed, nil)
			}
		})
	}
	wg.Go(func() {
		for range 200 {
			if o, err := f.Subscribe(flowapi.Request{Namespace: "a"}); err == nil {
				o.Close()
			}
		}
	})
	wg.Wait()
	cancel()
	<-read
	// Every event is queued or counted by now: the rest the reader left.
	for _, msg := range drain(t, s) {
		if msg.Type == flowapi.TypeDropped {
			told += msg.Dropped
		} else {
			received++
		}
	}
	if got := received + told; got != 2*workers*each {
		t.Errorf("received %d + told dropped %d = %d, want every event: %d", received, told, got, 2*workers*each)
	}
}
