package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/meshcontract"
)

var webID = spiffeid.RequireFromString("spiffe://cluster.local/ns/shop/sa/web")

// fakeAPI is a Workload API server whose X.509-SVID stream sends what the
// test pushes on msgs (a nil response ends the stream with end).
type fakeAPI struct {
	workloadpb.UnimplementedSpiffeWorkloadAPIServer
	msgs   chan *workloadpb.X509SVIDResponse
	end    chan error
	bundle []byte
	// opened receives one value per X.509-SVID stream opened.
	opened chan struct{}
}

func (f *fakeAPI) FetchX509SVID(_ *workloadpb.X509SVIDRequest, s grpc.ServerStreamingServer[workloadpb.X509SVIDResponse]) error {
	f.opened <- struct{}{}
	for {
		select {
		case m := <-f.msgs:
			if err := s.Send(m); err != nil {
				return err
			}
		case err := <-f.end:
			return err
		case <-s.Context().Done():
			return nil
		}
	}
}

func (f *fakeAPI) FetchX509Bundles(_ *workloadpb.X509BundlesRequest, s grpc.ServerStreamingServer[workloadpb.X509BundlesResponse]) error {
	if err := s.Send(&workloadpb.X509BundlesResponse{Bundles: map[string][]byte{"spiffe://cluster.local": f.bundle}}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// cert signs a certificate for tmpl with parent/parentKey (self-signed
// when parent is nil) and returns its DER and key.
func cert(t *testing.T, tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) ([]byte, *ecdsa.PrivateKey) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if parent == nil {
		parent, parentKey = tmpl, k
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, k.Public(), parentKey)
	if err != nil {
		t.Fatal(err)
	}
	return der, k
}

// newSVIDs returns a CA (DER) and a function minting SVIDs of id from it
// valid until notAfter, as Workload API entries.
func newSVIDs(t *testing.T) (caDER []byte, mint func(id spiffeid.ID, notAfter time.Time) *workloadpb.X509SVID) {
	t.Helper()
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
		URIs: []*url.URL{{Scheme: "spiffe", Host: "cluster.local"}},
	}
	caDER, caKey := cert(t, caTmpl, nil, nil)
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	serial := int64(1)
	return caDER, func(id spiffeid.ID, notAfter time.Time) *workloadpb.X509SVID {
		serial++
		der, k := cert(t, &x509.Certificate{
			SerialNumber: big.NewInt(serial), NotBefore: now.Add(-time.Minute), NotAfter: notAfter,
			URIs: []*url.URL{id.URL()}, KeyUsage: x509.KeyUsageDigitalSignature, BasicConstraintsValid: true,
		}, ca, caKey)
		kd, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return &workloadpb.X509SVID{SpiffeId: id.String(), X509Svid: der, X509SvidKey: kd, Bundle: caDER}
	}
}

// serveFake serves f on a unix socket at path, and writes a token next
// to it that every call must carry (as aether-agent does). It returns the
// server; the test's end stops it.
func serveFake(t *testing.T, path string, f *fakeAPI) *grpc.Server {
	t.Helper()
	tok := fmt.Sprintf("token-%d", time.Now().UnixNano())
	if err := os.WriteFile(DefaultTokenFile(path), []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		md, _ := metadata.FromIncomingContext(ss.Context())
		if got := md.Get(meshcontract.WorkloadAPITokenMetadata); len(got) != 1 || got[0] != tok {
			return status.Errorf(codes.PermissionDenied, "token in %s: %q, want %q", meshcontract.WorkloadAPITokenMetadata, got, tok)
		}
		return h(srv, ss)
	}))
	workloadpb.RegisterSpiffeWorkloadAPIServer(g, f)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	return g
}

// runWatcher runs w until the test ends.
func runWatcher(t *testing.T, w *Watcher) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v after its context ended; want nil", err)
		}
	})
}

// waitFor waits (on Changed, no sleeping) until cond holds, failing after 10s.
func waitFor(t *testing.T, w *Watcher, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		ch := w.Changed()
		if cond() {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestWatcherStartsBeforeTheSocket: Run starts with no socket, retries, and
// picks up the SVID and the bundle once a server appears; a rotation
// replaces the SVID; PermissionDenied drops it, another error keeps it.
func TestWatcherStartsBeforeTheSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "workload.sock")
	now := time.Now()
	clock := now
	w := New(sock, "", func() time.Time { return clock }, nil)
	runWatcher(t, w)
	if _, ok := w.SVID(webID); ok || w.Bundle() != nil {
		t.Fatal("SVID or bundle before any server")
	}

	caDER, mint := newSVIDs(t)
	f := &fakeAPI{msgs: make(chan *workloadpb.X509SVIDResponse, 4), end: make(chan error, 1), bundle: caDER, opened: make(chan struct{}, 8)}
	first := mint(webID, now.Add(time.Hour))
	f.msgs <- &workloadpb.X509SVIDResponse{Svids: []*workloadpb.X509SVID{first}}
	serveFake(t, sock, f)

	waitFor(t, w, "the first SVID", func() bool { _, ok := w.SVID(webID); return ok })
	<-f.opened
	waitFor(t, w, "the bundle", func() bool { return w.Bundle() != nil })
	if b := w.Bundle(); b.TrustDomain().Name() != "cluster.local" || string(b.X509Authorities()[0].Raw) != string(caDER) {
		t.Fatalf("bundle = %v", b)
	}
	if _, err := w.GetX509BundleForTrustDomain(webID.TrustDomain()); err != nil {
		t.Fatal(err)
	}

	rotated := mint(webID, now.Add(2*time.Hour))
	f.msgs <- &workloadpb.X509SVIDResponse{Svids: []*workloadpb.X509SVID{rotated}}
	waitFor(t, w, "the rotated SVID", func() bool {
		sv, ok := w.SVID(webID)
		return ok && string(sv.Certificates[0].Raw) == string(rotated.GetX509Svid())
	})

	// An SVID past its NotAfter is not handed out.
	clock = now.Add(3 * time.Hour)
	if _, ok := w.SVID(webID); ok {
		t.Fatal("expired SVID handed out")
	}
	clock = now

	tests := []struct {
		name string
		end  error
		keep bool
	}{
		{"unavailable keeps the SVIDs", status.Error(codes.Unavailable, "agent restarting"), true},
		{"permission denied drops them", status.Error(codes.PermissionDenied, "no identity issued"), false},
	}
	for _, tc := range tests {
		f.end <- tc.end
		if tc.keep {
			// go-spiffe reports the error before it reconnects: once the
			// next stream opens, the error has been handled.
			select {
			case <-f.opened:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: the watch did not reconnect", tc.name)
			}
			if _, ok := w.SVID(webID); !ok {
				t.Fatalf("%s: SVID gone", tc.name)
			}
			continue
		}
		waitFor(t, w, tc.name, func() bool { _, ok := w.SVID(webID); return !ok })
		if len(w.IDs()) != 0 || w.Bundle() == nil {
			t.Fatalf("%s: ids %v, bundle %v; want none and the bundle kept", tc.name, w.IDs(), w.Bundle())
		}
	}
}

// TestTokenReadAgainAfterRestart: the watcher sends the token of the file
// next to the socket on every call and reads the file again at every
// reconnect: a server restarted with a new token (as a restarted agent
// writes one) serves the watcher again; a refusal that names the token
// keeps the SVIDs.
func TestTokenReadAgainAfterRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "workload.sock")
	w := New(sock, "", nil, nil)
	runWatcher(t, w)
	caDER, mint := newSVIDs(t)
	newFake := func() *fakeAPI {
		return &fakeAPI{msgs: make(chan *workloadpb.X509SVIDResponse, 4), end: make(chan error, 1), bundle: caDER, opened: make(chan struct{}, 8)}
	}
	f := newFake()
	first := mint(webID, time.Now().Add(time.Hour))
	f.msgs <- &workloadpb.X509SVIDResponse{Svids: []*workloadpb.X509SVID{first}}
	g := serveFake(t, sock, f)
	waitFor(t, w, "the first SVID", func() bool { _, ok := w.SVID(webID); return ok })

	// A refusal for the token is not "no identity": the SVIDs stay.
	f.end <- status.Errorf(codes.PermissionDenied, "workload api token in metadata %s does not match", meshcontract.WorkloadAPITokenMetadata)
	select {
	case <-f.opened: // the first stream
	default:
	}
	select {
	case <-f.opened: // the reconnect after the refusal
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not reconnect after a token refusal")
	}
	if _, ok := w.SVID(webID); !ok {
		t.Fatal("a token refusal dropped the SVIDs")
	}

	// The "agent" restarts with a new token; its first message carries a
	// new SVID, which the watcher gets only if it sent the new token.
	g.Stop()
	f2 := newFake()
	second := mint(webID, time.Now().Add(2*time.Hour))
	f2.msgs <- &workloadpb.X509SVIDResponse{Svids: []*workloadpb.X509SVID{second}}
	serveFake(t, sock, f2)
	waitFor(t, w, "the SVID of the restarted server", func() bool {
		sv, ok := w.SVID(webID)
		return ok && string(sv.Certificates[0].Raw) == string(second.GetX509Svid())
	})
}

// TestTokenCredentials: the metadata is the file's token without the
// newline; a missing or empty file is an error naming the file.
func TestTokenCredentials(t *testing.T) {
	path := filepath.Join(t.TempDir(), meshcontract.WorkloadAPITokenFile)
	c := TokenCredentials(path)
	if _, err := c.GetRequestMetadata(context.Background()); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("missing file: %v; want an error naming %s", err, path)
	}
	if err := os.WriteFile(path, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetRequestMetadata(context.Background()); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("empty file: %v; want an error", err)
	}
	if err := os.WriteFile(path, []byte("abc\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	md, err := c.GetRequestMetadata(context.Background())
	if err != nil || len(md) != 1 || md[meshcontract.WorkloadAPITokenMetadata] != "abc" {
		t.Fatalf("metadata = %v, %v; want %s: abc", md, err, meshcontract.WorkloadAPITokenMetadata)
	}
	if c.RequireTransportSecurity() {
		t.Error("RequireTransportSecurity = true; the token goes over a unix socket")
	}
}
