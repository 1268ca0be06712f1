package workloadapi

import (
	"context"
	"crypto/x509"
	"net"
	"testing"
	"time"

	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"aether.io/node/agent/identity"
	"aether.io/node/agent/identity/identitytest"
)

var (
	td = spiffeid.RequireTrustDomainFromString("cluster.local")
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
)

// clock is the store's injected time.
type clock struct{ now time.Time }

func (c *clock) Now() time.Time { return c.now }

func newStore(t testing.TB, ttl time.Duration) (*identity.Store, *clock) {
	t.Helper()
	spec := identitytest.Spec{IsCA: true, NotBefore: t0.Add(-time.Hour), NotAfter: t0.Add(365 * 24 * time.Hour), URI: "spiffe://cluster.local"}
	c, k, _ := identitytest.CA(t, spec)
	ca, err := identity.ParseCA(c, k, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	clk := &clock{now: t0}
	return identity.NewStore(ca, ttl, clk.Now), clk
}

// serve serves srv over an in-memory connection and returns a client.
func serve(t testing.TB, srv *Server) workloadpb.SpiffeWorkloadAPIClient {
	t.Helper()
	ln := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	srv.Register(g)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	cc, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return workloadpb.NewSpiffeWorkloadAPIClient(cc)
}

func withHeader(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, HeaderKey, HeaderValue)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestHeaderRequired(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	c := serve(t, New(st, nil))
	calls := map[string]func(ctx context.Context) error{
		"FetchX509SVID": func(ctx context.Context) error {
			s, err := c.FetchX509SVID(ctx, &workloadpb.X509SVIDRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"FetchX509Bundles": func(ctx context.Context) error {
			s, err := c.FetchX509Bundles(ctx, &workloadpb.X509BundlesRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"FetchJWTSVID": func(ctx context.Context) error {
			_, err := c.FetchJWTSVID(ctx, &workloadpb.JWTSVIDRequest{Audience: []string{"a"}})
			return err
		},
		"FetchJWTBundles": func(ctx context.Context) error {
			s, err := c.FetchJWTBundles(ctx, &workloadpb.JWTBundlesRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"ValidateJWTSVID": func(ctx context.Context) error {
			_, err := c.ValidateJWTSVID(ctx, &workloadpb.ValidateJWTSVIDRequest{Audience: "a", Svid: "x"})
			return err
		},
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			if err := call(testCtx(t)); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("without the header: %v; want InvalidArgument", err)
			}
		})
	}
	for _, name := range []string{"FetchJWTSVID", "FetchJWTBundles", "ValidateJWTSVID"} {
		t.Run(name+"/with_header", func(t *testing.T) {
			if err := calls[name](withHeader(testCtx(t))); status.Code(err) != codes.Unimplemented {
				t.Fatalf("with the header: %v; want Unimplemented", err)
			}
		})
	}
}

// recvIDs receives one message and returns its SPIFFE IDs and serials.
func recvIDs(t *testing.T, s grpc.ServerStreamingClient[workloadpb.X509SVIDResponse], bundle []byte) (ids []string, serials map[string]string) {
	t.Helper()
	resp, err := s.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	serials = map[string]string{}
	for _, sv := range resp.GetSvids() {
		cert, err := x509.ParseCertificate(sv.GetX509Svid())
		if err != nil {
			t.Fatalf("SVID %q: %v", sv.GetSpiffeId(), err)
		}
		if _, err := x509.ParsePKCS8PrivateKey(sv.GetX509SvidKey()); err != nil {
			t.Fatalf("SVID %q key: %v", sv.GetSpiffeId(), err)
		}
		if string(sv.GetBundle()) != string(bundle) {
			t.Fatalf("SVID %q carries another bundle", sv.GetSpiffeId())
		}
		ids = append(ids, sv.GetSpiffeId())
		serials[sv.GetSpiffeId()] = cert.SerialNumber.String()
	}
	return ids, serials
}

// TestFetchX509SVIDStream follows one stream through the store's life: held
// open while empty, a message per mint, rotation and drop, PermissionDenied
// when the last SVID goes. The store's clock is injected; nothing sleeps.
func TestFetchX509SVIDStream(t *testing.T) {
	st, clk := newStore(t, 4*time.Hour)
	c := serve(t, New(st, nil))
	bundle := st.Bundle().X509Authorities()[0].Raw
	web := identity.Account{Namespace: "shop", ServiceAccount: "web"}
	db := identity.Account{Namespace: "data", ServiceAccount: "db"}
	const webID, dbID = "spiffe://cluster.local/ns/shop/sa/web", "spiffe://cluster.local/ns/data/sa/db"

	s, err := c.FetchX509SVID(withHeader(testCtx(t)), &workloadpb.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// Empty store: the stream stays open and silent, so the first message
	// received is the one after the first mint (not an error, not empty).
	if err := st.Sync([]identity.Account{web}); err != nil {
		t.Fatal(err)
	}
	ids, first := recvIDs(t, s, bundle)
	if len(ids) != 1 || ids[0] != webID {
		t.Fatalf("first message = %v; want [%s]", ids, webID)
	}
	steps := []struct {
		name    string
		advance time.Duration
		want    []identity.Account
		ids     []string
		rotated []string // IDs whose serial must differ from the previous message
	}{
		{"a second account", time.Minute, []identity.Account{web, db}, []string{dbID, webID}, nil},
		{"rotation at half-life", 2 * time.Hour, []identity.Account{web, db}, []string{dbID, webID}, []string{dbID, webID}},
		{"one account dropped", time.Minute, []identity.Account{db}, []string{dbID}, nil},
	}
	prev := first
	for _, step := range steps {
		clk.now = clk.now.Add(step.advance)
		if err := st.Sync(step.want); err != nil {
			t.Fatal(err)
		}
		ids, serials := recvIDs(t, s, bundle)
		if len(ids) != len(step.ids) {
			t.Fatalf("%s: message = %v; want %v", step.name, ids, step.ids)
		}
		for i := range ids {
			if ids[i] != step.ids[i] {
				t.Fatalf("%s: message = %v; want %v", step.name, ids, step.ids)
			}
		}
		for _, id := range step.rotated {
			if serials[id] == prev[id] {
				t.Fatalf("%s: %s not rotated (serial %s)", step.name, id, serials[id])
			}
		}
		prev = serials
	}
	if err := st.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("after the last SVID went: %v; want PermissionDenied", err)
	}
}

func TestFetchX509BundlesWhileEmpty(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	srv := New(st, nil)
	c := serve(t, srv)
	s, err := c.FetchX509Bundles(withHeader(testCtx(t)), &workloadpb.X509BundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	got := resp.GetBundles()["spiffe://cluster.local"]
	if len(resp.GetBundles()) != 1 || string(got) != string(st.Bundle().X509Authorities()[0].Raw) {
		t.Fatalf("bundles = %v; want the CA under spiffe://cluster.local", resp.GetBundles())
	}
	srv.Stop()
	if _, err := s.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("after Stop: %v; want Unavailable", err)
	}
}

func TestStopEndsSVIDStreams(t *testing.T) {
	st, _ := newStore(t, time.Hour)
	srv := New(st, nil)
	c := serve(t, srv)
	s, err := c.FetchX509SVID(withHeader(testCtx(t)), &workloadpb.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	if _, err := s.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("after Stop: %v; want Unavailable", err)
	}
}

// TestResponseBuiltOncePerChange: streams share one response per change,
// and an SVID that did not change keeps its encoded entry.
func TestResponseBuiltOncePerChange(t *testing.T) {
	st, clk := newStore(t, 4*time.Hour)
	srv := New(st, nil)
	web := identity.Account{Namespace: "shop", ServiceAccount: "web"}
	db := identity.Account{Namespace: "data", ServiceAccount: "db"}
	if err := st.Sync([]identity.Account{web}); err != nil {
		t.Fatal(err)
	}
	r1, _, err := srv.x509Response()
	if err != nil {
		t.Fatal(err)
	}
	r2, _, _ := srv.x509Response()
	if r1 != r2 {
		t.Fatal("a second stream got a rebuilt response for the same state")
	}
	clk.now = clk.now.Add(time.Minute)
	if err := st.Sync([]identity.Account{web, db}); err != nil {
		t.Fatal(err)
	}
	r3, _, _ := srv.x509Response()
	if r3 == r1 || len(r3.GetSvids()) != 2 {
		t.Fatalf("response after a change = %v", r3)
	}
	if r3.GetSvids()[1] != r1.GetSvids()[0] {
		t.Fatal("the unchanged SVID of web was encoded again")
	}
}

// TestCARotationStreams: a new CA with the old one kept as an anchor reaches
// open streams at once: the bundle stream gets both CAs, the SVID stream the
// held SVIDs with the new bundle, then the SVIDs the new CA re-minted.
func TestCARotationStreams(t *testing.T) {
	st, _ := newStore(t, 4*time.Hour)
	srv := New(st, nil)
	c := serve(t, srv)
	web := identity.Account{Namespace: "shop", ServiceAccount: "web"}
	if err := st.Sync([]identity.Account{web}); err != nil {
		t.Fatal(err)
	}
	ctx := withHeader(testCtx(t))
	svids, err := c.FetchX509SVID(ctx, &workloadpb.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	bundles, err := c.FetchX509Bundles(ctx, &workloadpb.X509BundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	oldCA := st.Bundle().X509Authorities()[0]
	_, first := recvIDs(t, svids, oldCA.Raw)
	if resp, err := bundles.Recv(); err != nil || string(resp.GetBundles()[td.IDString()]) != string(oldCA.Raw) {
		t.Fatalf("first bundle = %v, %v", resp, err)
	}

	spec := identitytest.Spec{IsCA: true, NotBefore: t0.Add(-time.Hour), NotAfter: t0.Add(365 * 24 * time.Hour), URI: "spiffe://cluster.local"}
	cp, kp, _ := identitytest.CA(t, spec)
	ca2, err := identity.ParseCA(cp, kp, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	if !st.SetCA(ca2, []*x509.Certificate{oldCA}) {
		t.Fatal("SetCA reported no change")
	}
	var both []byte
	for _, a := range st.Bundle().X509Authorities() {
		both = append(both, a.Raw...)
	}
	if resp, err := bundles.Recv(); err != nil || string(resp.GetBundles()[td.IDString()]) != string(both) {
		t.Fatalf("bundle after the rotation = %v, %v; want both CAs", resp, err)
	}
	// The held SVID, now with the two-CA bundle.
	if _, serials := recvIDs(t, svids, both); serials["spiffe://cluster.local/ns/shop/sa/web"] != first["spiffe://cluster.local/ns/shop/sa/web"] {
		t.Fatal("the bundle change re-minted before the sync")
	}
	if err := st.Sync([]identity.Account{web}); err != nil {
		t.Fatal(err)
	}
	resp, err := svids.Recv()
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(resp.GetSvids()[0].GetX509Svid())
	if err != nil {
		t.Fatal(err)
	}
	newCA := st.Bundle().X509Authorities()[0]
	if err := cert.CheckSignatureFrom(newCA); err != nil || string(resp.GetSvids()[0].GetBundle()) != string(both) {
		t.Fatalf("re-minted SVID: signature by the new CA: %v; bundle holds both: %v", err, string(resp.GetSvids()[0].GetBundle()) == string(both))
	}
}
