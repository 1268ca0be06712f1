package identity

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
	"testing"
	"time"

	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// serveFake serves f on a unix socket at path.
func serveFake(t *testing.T, path string, f *fakeAPI) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	workloadpb.RegisterSpiffeWorkloadAPIServer(g, f)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
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
	w := New(sock, func() time.Time { return clock }, nil)
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
