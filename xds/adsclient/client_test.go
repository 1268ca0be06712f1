package adsclient_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	listener "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"

	"aether.io/node/xds/adsclient"
	"aether.io/node/xds/resource"
)

const typeURL = resource.ListenerType

// serve runs go-control-plane's delta server for cache on socket until the
// returned stop is called; requests are copied to reqs.
func serve(t *testing.T, socket string, cache cachev3.Cache, reqs chan<- *discovery.DeltaDiscoveryRequest) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cb := serverv3.CallbackFuncs{StreamDeltaRequestFunc: func(_ int64, r *discovery.DeltaDiscoveryRequest) error {
		select {
		case reqs <- r:
		default:
		}
		return nil
	}}
	g := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(g, serverv3.NewServer(ctx, cache, cb))
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	var once sync.Once
	stop = func() { once.Do(func() { g.Stop(); cancel() }) }
	t.Cleanup(stop)
	return stop
}

type state struct {
	mu    sync.Mutex
	names map[string]bool
}

func (s *state) has(n string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.names[n]
}

func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// run runs c until the test ends. Run's result arrives on done (a reader
// puts it back for the cleanup); wctx bounds the test's waits.
func run(t *testing.T, c *adsclient.Client) (done chan error, wctx context.Context) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(wcancel)
	return done, wctx
}

// TestDeltaSubscribeAckNackReconnect: wildcard subscription, updates and
// removals reach the handler, a handler error is sent as a NACK, and a
// reconnect carries initial_resource_versions for what the client holds.
func TestDeltaSubscribeAckNackReconnect(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "xds.sock")
	cache := cachev3.NewLinearCache(typeURL)
	if err := cache.UpdateResource("a", &listener.Listener{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	reqs := make(chan *discovery.DeltaDiscoveryRequest, 256)
	stop := serve(t, socket, cache, reqs)

	st := &state{names: map[string]bool{}}
	c := &adsclient.Client{
		Target: "unix://" + socket, TypeURLs: []string{typeURL}, MaxBackoff: 200 * time.Millisecond,
		Handler: func(_ string, updated []*discovery.Resource, removed []string) error {
			st.mu.Lock()
			defer st.mu.Unlock()
			for _, r := range updated {
				if r.GetName() == "bad" {
					return errors.New("resource bad is bad")
				}
				st.names[r.GetName()] = true
			}
			for _, n := range removed {
				delete(st.names, n)
			}
			return nil
		},
	}
	_, wctx := run(t, c)

	first := <-reqs
	if first.GetTypeUrl() != typeURL || len(first.GetResourceNamesSubscribe()) != 1 || first.GetResourceNamesSubscribe()[0] != "*" {
		t.Fatalf("first request %v, want a wildcard subscription to %s", first, typeURL)
	}
	if err := waitFor(wctx, func() bool { return st.has("a") }); err != nil {
		t.Fatal("resource a never arrived")
	}
	if err := cache.UpdateResource("b", &listener.Listener{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	if err := cache.DeleteResource("a"); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(wctx, func() bool { return st.has("b") && !st.has("a") }); err != nil {
		t.Fatal("update and removal never arrived")
	}
	if err := cache.UpdateResource("bad", &listener.Listener{Name: "bad"}); err != nil {
		t.Fatal(err)
	}
	for {
		r := <-reqs
		if r.GetErrorDetail() != nil {
			if r.GetErrorDetail().GetMessage() != "resource bad is bad" {
				t.Errorf("NACK message %q", r.GetErrorDetail().GetMessage())
			}
			break
		}
	}
	// Reconnect: the new stream announces b (the only resource ACKed and
	// held), not the NACKed one.
	if err := cache.DeleteResource("bad"); err != nil {
		t.Fatal(err)
	}
	stop()
	for len(reqs) > 0 {
		<-reqs
	}
	serve(t, socket, cache, reqs)
	for {
		select {
		case r := <-reqs:
			if len(r.GetResourceNamesSubscribe()) == 0 {
				continue // an ACK of the old stream
			}
			iv := r.GetInitialResourceVersions()
			if _, ok := iv["b"]; !ok || len(iv) != 1 {
				t.Fatalf("reconnect initial_resource_versions = %v, want just b", iv)
			}
			return
		case <-wctx.Done():
			t.Fatal("no reconnect")
		}
	}
}

// TestNamedOnceSynced: a named subscription with initial versions reaches
// the server as one request, only the named resource arrives, Synced closes
// after its first ACK, Subscribe adds a name on the open stream, and a
// Once client returns the stream's error instead of reconnecting.
func TestNamedOnceSynced(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "xds.sock")
	cache := cachev3.NewLinearCache(typeURL)
	for _, n := range []string{"a", "b"} {
		if err := cache.UpdateResource(n, &listener.Listener{Name: n}); err != nil {
			t.Fatal(err)
		}
	}
	reqs := make(chan *discovery.DeltaDiscoveryRequest, 256)
	serve(t, socket, cache, reqs)

	st := &state{names: map[string]bool{}}
	c := &adsclient.Client{
		Target: "unix://" + socket, TypeURLs: []string{typeURL}, Once: true, MaxMessageBytes: 1 << 20,
		Names:           map[string][]string{typeURL: {"a"}},
		InitialVersions: map[string]map[string]string{typeURL: {"a": "stale"}},
		Handler: func(_ string, updated []*discovery.Resource, _ []string) error {
			st.mu.Lock()
			defer st.mu.Unlock()
			for _, r := range updated {
				st.names[r.GetName()] = true
			}
			return nil
		},
	}
	done, wctx := run(t, c)

	first := <-reqs
	if got := first.GetResourceNamesSubscribe(); len(got) != 1 || got[0] != "a" {
		t.Errorf("first request subscribes %v, want [a]", got)
	}
	if got := first.GetInitialResourceVersions(); len(got) != 1 || got["a"] != "stale" {
		t.Errorf("first request initial_resource_versions %v, want a=stale", got)
	}
	select {
	case <-c.Synced():
	case <-wctx.Done():
		t.Fatal("never synced")
	}
	if !st.has("a") || st.has("b") {
		t.Fatalf("holds %v, want just a", st.names)
	}
	if v := c.Versions(typeURL); v["a"] == "" || v["a"] == "stale" || len(v) != 1 {
		t.Errorf("versions %v, want a's served version only", v)
	}
	if err := c.Subscribe(typeURL, "b"); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(wctx, func() bool { return st.has("b") }); err != nil {
		t.Fatal("b never arrived after Subscribe")
	}

	// A response above MaxMessageBytes ends the stream; Once returns why.
	if err := cache.UpdateResource("b", &listener.Listener{Name: "b", StatPrefix: strings.Repeat("x", 2<<20)}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err == nil || !strings.Contains(err.Error(), "larger than max") {
			t.Fatalf("Run = %v, want the message size error", err)
		}
	case <-wctx.Done():
		t.Fatal("Once client kept running after its stream failed")
	}
}

// TestOnceUnreachable: a Once client does not wait for an absent server.
func TestOnceUnreachable(t *testing.T) {
	c := &adsclient.Client{
		Target: "unix://" + filepath.Join(t.TempDir(), "none.sock"), TypeURLs: []string{typeURL}, Once: true,
		Handler: func(string, []*discovery.Resource, []string) error { return nil },
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.Run(ctx); err == nil || ctx.Err() != nil {
		t.Fatalf("Run = %v (ctx %v), want a connection error before the deadline", err, ctx.Err())
	}
}
