package flowserver_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/flowserver"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// serve runs a flows server of m's hub on a socket in a fresh directory
// until the test ends, and returns the socket's path.
func serve(t *testing.T, m *telemetry.Metrics, o flowserver.Options) (string, *flowserver.Server) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "flows", "flows.sock")
	ln, err := flowserver.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := flowserver.New(m.Flows(), o)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return sock, srv
}

// conn is one connection from web (a/web-1) to db (b/db-0) through
// Service b/db, as the source side reports it.
func conn(reporter string) telemetry.ConnInfo {
	return telemetry.ConnInfo{
		Reporter: reporter, Src: netip.MustParseAddrPort("10.0.0.5:40000"), Dst: netip.MustParseAddrPort("10.0.0.6:5432"),
		Source:      peers.Peer{Workload: "web", Name: "web-1", Namespace: "a"},
		Destination: peers.Peer{Workload: "db", Name: "db-0", Namespace: "b"},
		Service:     peers.ServiceRef{Name: "db", Namespace: "b", Hostname: "db.b.svc.cluster.local"}, Path: telemetry.PathPlaintext,
	}
}

func metric(t *testing.T, m *telemetry.Metrics, name string) float64 {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue() + mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestServe: a subscriber over the socket gets the events its filter
// keeps, the open and then the close, as flat JSON lines; leaving ends its
// subscription on the server.
func TestServe(t *testing.T) {
	m := telemetry.New()
	sock, _ := serve(t, m, flowserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := flowapi.Subscribe(ctx, sock, flowapi.Request{Reporter: "source"})
	if err != nil {
		t.Fatal(err)
	}
	if s.Queue != telemetry.FlowQueue {
		t.Errorf("queue %d, want %d", s.Queue, telemetry.FlowQueue)
	}
	m.Refused(conn(telemetry.ReporterDestination), telemetry.ReasonDenied, errors.New("refused")) // filtered out
	c := m.Open(conn(telemetry.ReporterSource))
	c.Received(5)
	c.Close(telemetry.ReasonClientClosed, nil)
	for i, want := range []flowapi.Message{
		{Type: flowapi.TypeOpened, Event: &flowapi.Event{Reporter: "source", SrcPod: "web-1", DstPod: "db-0", DstService: "db.b.svc.cluster.local"}},
		{Type: flowapi.TypeClosed, Event: &flowapi.Event{Reporter: "source", SrcPod: "web-1", DstPod: "db-0", DstService: "db.b.svc.cluster.local", BytesToDst: 5, Reason: "client_closed"}},
	} {
		got, err := s.Next()
		if err != nil {
			t.Fatal(err)
		}
		if got.Type != want.Type || got.Event == nil || got.Reporter != want.Reporter || got.SrcPod != want.SrcPod || got.DstPod != want.DstPod ||
			got.DstService != want.DstService || got.BytesToDst != want.BytesToDst || got.Reason != want.Reason {
			t.Errorf("message %d: %+v %+v, want %+v %+v", i, got, got.Event, want, want.Event)
		}
	}
	if got := m.Flows().Subscribers(); got != 1 {
		t.Errorf("%d subscribers, want 1", got)
	}
	_ = s.Close()
	// The server's goroutine ends the subscription when it sees the
	// client leave.
	if err := proxytest.WaitFor(ctx, func() bool { return m.Flows().Subscribers() == 0 }); err != nil {
		t.Errorf("%d subscribers after the client left", m.Flows().Subscribers())
	}
}

// TestRefusals: a peer whose uid is not allowed, a request that is not
// JSON, names a filter the server does not know, is too long, or is
// invalid, and one subscriber too many are each answered an error line
// that says why.
func TestRefusals(t *testing.T) {
	m := telemetry.New()
	sock, _ := serve(t, m, flowserver.Options{AllowedUIDs: []uint32{4242}})
	ctx := context.Background()
	_, err := flowapi.Subscribe(ctx, sock, flowapi.Request{})
	var re *flowapi.RefusedError
	if !errors.As(err, &re) || re.Detail != "permission denied: peer uid 0 may not follow flows (allowed uids: [4242])" {
		t.Errorf("Subscribe as uid 0 = %v, want refused", err)
	}
	if got := metric(t, m, "aether_proxy_flow_peers_rejected_total"); got != 1 {
		t.Errorf("aether_proxy_flow_peers_rejected_total = %v, want 1", got)
	}

	m = telemetry.New()
	sock, _ = serve(t, m, flowserver.Options{AllowedUIDs: []uint32{uint32(os.Getuid())}})
	for _, tc := range []struct{ line, want string }{
		{"not json\n", `invalid request "not json"`},
		{`{"pod":"a/web-1","since":"1h"}` + "\n", `json: unknown field "since"`},
		{`{"pod":"web-1"}` + "\n", `invalid pod "web-1": want <namespace>/<name>`},
		{`{"service":"` + strings.Repeat("x", flowapi.MaxRequestBytes) + `"}` + "\n", "invalid request: longer than 4096 bytes"},
	} {
		if got := rawRequest(t, sock, tc.line); got.Type != flowapi.TypeError || !strings.Contains(got.Detail, tc.want) {
			t.Errorf("request %.40q: answer %+v, want an error with %q", tc.line, got, tc.want)
		}
	}
	for range telemetry.MaxFlowSubscribers {
		s, err := flowapi.Subscribe(ctx, sock, flowapi.Request{})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
	}
	if _, err := flowapi.Subscribe(ctx, sock, flowapi.Request{}); !errors.As(err, &re) || !strings.Contains(re.Detail, "too many flow subscribers") {
		t.Errorf("one subscriber too many: %v", err)
	}
}

// rawRequest sends line on a new connection and returns the answer.
func rawRequest(t *testing.T, sock, line string) flowapi.Message {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(c, line); err != nil {
		t.Fatal(err)
	}
	var m flowapi.Message
	if err := json.NewDecoder(c).Decode(&m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestSlowReader: a client that stops reading holds up no publisher: its
// queue fills, the rest is dropped and counted, and when it reads again it
// gets its queue and is told how many it lost; every event is one or the
// other. Close then ends a client whose writes are stuck.
func TestSlowReader(t *testing.T) {
	m := telemetry.New()
	sock, srv := serve(t, m, flowserver.Options{})
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "{}\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	in := bufio.NewReader(c)
	dec := json.NewDecoder(in)
	var answer flowapi.Message
	if err := dec.Decode(&answer); err != nil || answer.Type != flowapi.TypeSubscribed {
		t.Fatalf("answer %+v, %v", answer, err)
	}
	// Far more than the queue and the socket buffers hold: the client
	// reads nothing meanwhile.
	const published = 8 * telemetry.FlowQueue
	for range published {
		m.Refused(conn(telemetry.ReporterSource), telemetry.ReasonConnectFailed, nil)
	}
	dropped := metric(t, m, "aether_proxy_flow_events_dropped_total")
	if dropped == 0 {
		t.Fatalf("no event dropped for a client that reads nothing")
	}
	var events, told int
	for events+told < published {
		var msg flowapi.Message
		if err := dec.Decode(&msg); err != nil {
			t.Fatalf("after %d events and %d told dropped: %v", events, told, err)
		}
		switch msg.Type {
		case flowapi.TypeClosed:
			events++
		case flowapi.TypeDropped:
			told += int(msg.Dropped)
		default:
			t.Fatalf("unexpected %+v", msg)
		}
	}
	if float64(told) != dropped || events+told != published {
		t.Errorf("%d events + %d told dropped (metric %v), want %d in all", events, told, dropped, published)
	}
	t.Logf("%d events sent, %d dropped of %d", events, told, published)

	// A client stuck in a write: Close returns and the client sees the end.
	for range published {
		m.Refused(conn(telemetry.ReporterSource), telemetry.ReasonConnectFailed, nil)
	}
	srv.Close()
	if _, err := io.Copy(io.Discard, in); err != nil {
		t.Errorf("reading to the end after Close: %v", err)
	}
	if got := m.Flows().Subscribers(); got != 0 {
		t.Errorf("%d subscribers after Close", got)
	}
}

// TestListen: the socket is 0600; a directory readable by others (as
// kubelet creates a hostPath) is accepted, one writable by others is not;
// a live socket is not taken over.
func TestListen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "flows")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "flows.sock")
	ln, err := flowserver.Listen(sock)
	if err != nil {
		t.Fatalf("Listen in a 0755 dir: %v", err)
	}
	defer ln.Close()
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v, %v; want 0600", fi.Mode(), err)
	}
	if _, err := flowserver.Listen(sock); err == nil || !strings.Contains(err.Error(), "another process is serving it") {
		t.Errorf("Listen on a live socket: %v", err)
	}
	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := flowserver.Listen(filepath.Join(open, "flows.sock")); err == nil {
		t.Error("Listen in a 0777 dir succeeded")
	}
}
