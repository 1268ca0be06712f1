package spire

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"math/big"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	delegatedv1 "github.com/spiffe/spire-api-sdk/proto/spire/api/agent/delegatedidentity/v1"
	"github.com/spiffe/spire-api-sdk/proto/spire/api/types"
	"google.golang.org/grpc"
)

var (
	webID = spiffeid.RequireFromString("spiffe://cluster.local/ns/shop/sa/web")
	dbID  = spiffeid.RequireFromString("spiffe://cluster.local/ns/shop/sa/db")
)

// fakeAgent implements the SPIRE agent's Delegated Identity API: each SVID
// stream is keyed by its selectors ("k8s:ns:shop,k8s:sa:web") and sends
// what the test pushes for that key.
type fakeAgent struct {
	delegatedv1.UnimplementedDelegatedIdentityServer
	bundle []byte

	mu      sync.Mutex
	streams map[string]chan *delegatedv1.SubscribeToX509SVIDsResponse
	opened  chan string
	closed  chan string
}

func newFakeAgent(bundle []byte) *fakeAgent {
	return &fakeAgent{
		bundle: bundle, streams: map[string]chan *delegatedv1.SubscribeToX509SVIDsResponse{},
		opened: make(chan string, 16), closed: make(chan string, 16),
	}
}

func selectorKey(sel []*types.Selector) string {
	s := make([]string, 0, len(sel))
	for _, x := range sel {
		s = append(s, x.GetType()+":"+x.GetValue())
	}
	slices.Sort(s)
	return strings.Join(s, ",")
}

func (f *fakeAgent) SubscribeToX509SVIDs(req *delegatedv1.SubscribeToX509SVIDsRequest, s grpc.ServerStreamingServer[delegatedv1.SubscribeToX509SVIDsResponse]) error {
	key := selectorKey(req.GetSelectors())
	ch := make(chan *delegatedv1.SubscribeToX509SVIDsResponse, 4)
	f.mu.Lock()
	f.streams[key] = ch
	f.mu.Unlock()
	f.opened <- key
	defer func() { f.closed <- key }()
	for {
		select {
		case m := <-ch:
			if err := s.Send(m); err != nil {
				return err
			}
		case <-s.Context().Done():
			return nil
		}
	}
}

func (f *fakeAgent) SubscribeToX509Bundles(_ *delegatedv1.SubscribeToX509BundlesRequest, s grpc.ServerStreamingServer[delegatedv1.SubscribeToX509BundlesResponse]) error {
	if err := s.Send(&delegatedv1.SubscribeToX509BundlesResponse{CaCertificates: map[string][]byte{"spiffe://cluster.local": f.bundle}}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// push sends m on the open stream of key.
func (f *fakeAgent) push(t *testing.T, key string, m *delegatedv1.SubscribeToX509SVIDsResponse) {
	t.Helper()
	f.mu.Lock()
	ch := f.streams[key]
	f.mu.Unlock()
	if ch == nil {
		t.Fatalf("no stream of %q", key)
	}
	ch <- m
}

// serve runs f on the unix socket path until the returned stop is called
// (also in t.Cleanup).
func serve(t *testing.T, f *fakeAgent, path string) (stop func()) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	delegatedv1.RegisterDelegatedIdentityServer(srv, f)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(l) }()
	var once sync.Once
	stop = func() { once.Do(func() { srv.Stop(); <-done }) }
	t.Cleanup(stop)
	return stop
}

// ca is a test CA of trust domain cluster.local minting SVIDs.
type ca struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newCA(t *testing.T) *ca {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local"}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &ca{cert: c, key: k}
}

// mint returns a response carrying an SVID of id with serial and notAfter.
func (c *ca) mint(t *testing.T, id spiffeid.ID, serial int64, notAfter time.Time) *delegatedv1.SubscribeToX509SVIDsResponse {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	u := id.URL()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), NotBefore: time.Now().Add(-time.Minute), NotAfter: notAfter,
		KeyUsage: x509.KeyUsageDigitalSignature, URIs: []*url.URL{u},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, k.Public(), c.key)
	if err != nil {
		t.Fatal(err)
	}
	pk, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return &delegatedv1.SubscribeToX509SVIDsResponse{X509Svids: []*delegatedv1.X509SVIDWithKey{{
		X509Svid:    &types.X509SVID{CertChain: [][]byte{der}, Id: &types.SPIFFEID{TrustDomain: id.TrustDomain().Name(), Path: id.Path()}, ExpiresAt: notAfter.Unix()},
		X509SvidKey: pk,
	}}}
}

// run starts p.Run and joins it in t.Cleanup.
func run(t *testing.T, p *Provider) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	})
}

// eventually waits (bounded) until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func recv(t *testing.T, ch <-chan string, want string) {
	t.Helper()
	select {
	case got := <-ch:
		if got != want {
			t.Fatalf("stream %q, want %q", got, want)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("no stream event for %q", want)
	}
}

func serial(p *Provider, id spiffeid.ID) int64 {
	sv, ok := p.SVID(id)
	if !ok {
		return 0
	}
	return sv.Certificates[0].SerialNumber.Int64()
}

const webKey, dbKey = "k8s:ns:shop,k8s:sa:web", "k8s:ns:shop,k8s:sa:db"

// TestSubscribeRotateDrop: a wanted identity is subscribed with its k8s
// selectors, its SVID and the bundle arrive, a rotation replaces the SVID,
// and an identity no longer wanted is unsubscribed and its SVID dropped.
func TestSubscribeRotateDrop(t *testing.T) {
	c := newCA(t)
	f := newFakeAgent(c.cert.Raw)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	serve(t, f, sock)
	p := New(sock, nil, nil)
	p.Want([]spiffeid.ID{webID, dbID})
	run(t, p)

	got := []string{<-f.opened, <-f.opened}
	slices.Sort(got)
	if want := []string{dbKey, webKey}; !slices.Equal(got, want) {
		t.Fatalf("subscribed selectors %q, want %q", got, want)
	}
	notAfter := time.Now().Add(time.Hour)
	f.push(t, webKey, c.mint(t, webID, 10, notAfter))
	eventually(t, "the first svid", func() bool { return serial(p, webID) == 10 })
	eventually(t, "the bundle", func() bool { return p.Bundle() != nil })
	if b := p.Bundle(); b.TrustDomain() != webID.TrustDomain() || !b.HasX509Authority(c.cert) {
		t.Fatalf("bundle %v lacks the CA", b.TrustDomain())
	}

	f.push(t, webKey, c.mint(t, webID, 11, notAfter))
	eventually(t, "the rotated svid", func() bool { return serial(p, webID) == 11 })

	// An SVID of another identity matching the selectors is not webID's.
	f.push(t, dbKey, c.mint(t, webID, 12, notAfter))
	f.push(t, dbKey, c.mint(t, dbID, 13, notAfter))
	eventually(t, "db's svid", func() bool { return serial(p, dbID) == 13 })
	if serial(p, webID) != 11 {
		t.Fatalf("web's svid replaced by one sent on db's stream")
	}

	p.Want([]spiffeid.ID{dbID})
	recv(t, f.closed, webKey)
	if _, ok := p.SVID(webID); ok {
		t.Fatal("svid of an identity no longer wanted still served")
	}
	if s := p.Stats(); s.SVIDs != 1 || s.Wanted != 1 {
		t.Fatalf("stats %+v, want 1 svid and 1 wanted", s)
	}

	// No entry matches any more: the agent sends an empty list.
	f.push(t, dbKey, &delegatedv1.SubscribeToX509SVIDsResponse{})
	eventually(t, "db's svid dropped", func() bool { _, ok := p.SVID(dbID); return !ok })
}

// TestAgentRestart: the SVIDs outlive the agent's socket going away, the
// provider resubscribes to the restarted agent with backoff, and counts the
// failed streams.
func TestAgentRestart(t *testing.T) {
	c := newCA(t)
	f := newFakeAgent(c.cert.Raw)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	stop := serve(t, f, sock)
	p := New(sock, nil, nil)
	run(t, p)
	p.Want([]spiffeid.ID{webID}) // after Run: the wake path
	recv(t, f.opened, webKey)
	f.push(t, webKey, c.mint(t, webID, 20, time.Now().Add(time.Hour)))
	eventually(t, "the svid", func() bool { return serial(p, webID) == 20 })

	stop()
	eventually(t, "a counted stream failure", func() bool { return p.Stats().SubscriptionErrors > 0 })
	if serial(p, webID) != 20 {
		t.Fatal("svid dropped when the agent went away")
	}

	f2 := newFakeAgent(c.cert.Raw)
	serve(t, f2, sock)
	recv(t, f2.opened, webKey)
	f2.push(t, webKey, c.mint(t, webID, 21, time.Now().Add(time.Hour)))
	eventually(t, "the svid from the restarted agent", func() bool { return serial(p, webID) == 21 })
}

// TestExpiry: an expired SVID is not served although it is held.
func TestExpiry(t *testing.T) {
	c := newCA(t)
	f := newFakeAgent(c.cert.Raw)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	serve(t, f, sock)
	var mu sync.Mutex
	now := time.Now()
	p := New(sock, func() time.Time { mu.Lock(); defer mu.Unlock(); return now }, nil)
	p.Want([]spiffeid.ID{webID})
	run(t, p)
	recv(t, f.opened, webKey)
	f.push(t, webKey, c.mint(t, webID, 30, now.Add(time.Hour)))
	eventually(t, "the svid", func() bool { return serial(p, webID) == 30 })
	mu.Lock()
	now = now.Add(2 * time.Hour)
	mu.Unlock()
	if _, ok := p.SVID(webID); ok {
		t.Fatal("expired svid served")
	}
	if ids := p.IDs(); len(ids) != 1 {
		t.Fatalf("IDs = %v, want the expired one still held", ids)
	}
}

func TestSelectors(t *testing.T) {
	for _, tc := range []struct {
		id   string
		want string
	}{
		{"spiffe://cluster.local/ns/shop/sa/web", webKey},
		{"spiffe://td/ns/kube-system/sa/default", "k8s:ns:kube-system,k8s:sa:default"},
		{"spiffe://cluster.local/ns/shop", ""},
		{"spiffe://cluster.local/ns/shop/sa/web/extra", ""},
		{"spiffe://cluster.local/spire/agent/x", ""},
	} {
		t.Run(tc.id, func(t *testing.T) {
			sel, err := Selectors(spiffeid.RequireFromString(tc.id))
			if tc.want == "" {
				if err == nil {
					t.Fatalf("Selectors = %v, want an error", sel)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := selectorKey(sel); got != tc.want {
				t.Fatalf("Selectors = %q, want %q", got, tc.want)
			}
		})
	}
	p := New("unused", nil, nil)
	p.Want([]spiffeid.ID{spiffeid.RequireFromString("spiffe://cluster.local/spire/agent/x"), webID})
	if s := p.Stats(); s.Unsubscribable != 1 || s.Wanted != 1 {
		t.Fatalf("stats %+v, want 1 unsubscribable and 1 wanted", s)
	}
}
