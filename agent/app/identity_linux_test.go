package app

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"aether.io/node/agent/identity/identitytest"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/pkg/adminapi"
	proxyidentity "aether.io/node/proxy/identity"
)

// x509Watcher forwards go-spiffe's watch callbacks to channels.
type x509Watcher struct {
	updates chan *workloadapi.X509Context
	errs    chan error
}

func newX509Watcher() *x509Watcher {
	return &x509Watcher{updates: make(chan *workloadapi.X509Context, 16), errs: make(chan error, 16)}
}

func (w *x509Watcher) OnX509ContextUpdate(c *workloadapi.X509Context) { w.updates <- c }
func (w *x509Watcher) OnX509ContextWatchError(err error) {
	select {
	case w.errs <- err:
	default:
	}
}

// next returns the next update, failing after d.
func (w *x509Watcher) next(t *testing.T, what string, d time.Duration) *workloadapi.X509Context {
	t.Helper()
	select {
	case c := <-w.updates:
		return c
	case <-time.After(d):
		t.Fatalf("no X.509 context update within %s: %s", d, what)
		return nil
	}
}

func svidIDs(c *workloadapi.X509Context) []string {
	out := make([]string, 0, len(c.SVIDs))
	for _, s := range c.SVIDs {
		out = append(out, s.ID.String())
	}
	return out
}

// TestIdentityWorkloadAPI runs the agent with a CA and talks to its
// Workload API socket with go-spiffe's own client: an SVID appears when a
// managed pod is added through the CNI socket, rotates at half of
// --svid-ttl (pushed to the watcher), and goes with RemovePod.
func TestIdentityWorkloadAPI(t *testing.T) {
	// Registered first, so it runs last: after the agent stopped, every
	// goroutine of the identity parts has returned.
	leak := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, leak) })
	cert, key := identitytest.Files(t, t.TempDir(), identitytest.Valid("cluster.local"))
	sock := filepath.Join(t.TempDir(), "wl", "workload.sock")
	c := testConfig(t, "--ca-cert", cert, "--ca-key", key, "--svid-ttl", "4s", "--workload-api-socket", sock)
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("workload api socket: %v, %v; want mode 0600", fi, err)
	}

	cc, err := grpc.NewClient("unix://"+c.CNISocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	cni := cniv1grpc.NewCNIServiceClient(cc)
	writeManifestFile(t, c.PodManifests, "web-1", "uid-web-1", "n1")
	add := func() {
		t.Helper()
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		r, err := cni.AddPod(actx, &cniv1.AddPodRequest{Pod: &cniv1.CNIPod{
			Name: "web-1", Namespace: "shop", ContainerId: "cid-web-1", NetworkNamespace: "/var/run/netns/cid-web-1", Ips: []string{"10.1.0.5"},
		}})
		if err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			t.Fatalf("AddPod = %v, %v", r, err)
		}
	}

	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	// The token is next to the socket, 0600, 32 random bytes in hex; a
	// client of an allowed uid without it is refused.
	tokenFile := filepath.Join(filepath.Dir(sock), "workload-api.token")
	if fi, err := os.Stat(tokenFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v, %v; want mode 0600", fi, err)
	}
	if b, err := os.ReadFile(tokenFile); err != nil || !regexp.MustCompile(`^[0-9a-f]{64}\n$`).Match(b) {
		t.Fatalf("token file holds %q, %v; want 64 hex digits", b, err)
	}
	bare, err := workloadapi.New(wctx, workloadapi.WithAddr("unix://"+sock))
	if err != nil {
		t.Fatal(err)
	}
	_, err = bare.FetchX509Bundles(wctx)
	_ = bare.Close()
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), tokenFile) {
		t.Fatalf("FetchX509Bundles without the token = %v; want PermissionDenied naming %s", err, tokenFile)
	}
	client, err := workloadapi.New(wctx, workloadapi.WithAddr("unix://"+sock),
		workloadapi.WithDialOptions(grpc.WithPerRPCCredentials(proxyidentity.TokenCredentials(tokenFile))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	w := newX509Watcher()
	watchDone := make(chan error, 1)
	go func() { watchDone <- client.WatchX509Context(wctx, w) }()
	t.Cleanup(func() {
		cancel()
		<-watchDone
	})

	// The node holds no SVID yet: the watch waits (no update) until AddPod.
	add()
	const want = "spiffe://cluster.local/ns/shop/sa/default"
	first := w.next(t, "after AddPod", 10*time.Second)
	if ids := svidIDs(first); len(ids) != 1 || ids[0] != want {
		t.Fatalf("SVIDs after AddPod = %v; want [%s]", ids, want)
	}
	if b, err := first.Bundles.GetX509BundleForTrustDomain(first.SVIDs[0].ID.TrustDomain()); err != nil || len(b.X509Authorities()) != 1 {
		t.Fatalf("bundle of the SVID's trust domain: %v, %v", b, err)
	}
	// The admin API (aetherctl pod) shows the pod's SPIFFE ID.
	views, err := adminapi.NewClient(c.AdminSocket).Pods(wctx)
	if err != nil || len(views) != 1 || views[0].SPIFFEID != want {
		t.Fatalf("admin pods = %+v, %v; want one with SPIFFE ID %s", views, err, want)
	}
	// The one-shot fetch of go-spiffe's client gets the same SVID.
	svids, err := client.FetchX509SVIDs(wctx)
	if err != nil || len(svids) != 1 || svids[0].ID.String() != want {
		t.Fatalf("FetchX509SVIDs = %v, %v", svids, err)
	}

	// 4s TTL: rotated ~1.5s after the mint, and pushed.
	rotated := w.next(t, "rotation", 10*time.Second)
	a, b := first.SVIDs[0].Certificates[0], rotated.SVIDs[0].Certificates[0]
	if a.SerialNumber.Cmp(b.SerialNumber) == 0 || !b.NotAfter.After(a.NotAfter) {
		t.Fatalf("rotation pushed the same certificate (serial %s, not after %s)", b.SerialNumber, b.NotAfter)
	}

	// RemovePod drops the last SVID: the stream ends with PermissionDenied,
	// go-spiffe's watcher reports it and keeps watching.
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	if _, err := cni.RemovePod(rctx, &cniv1.RemovePodRequest{ContainerId: "cid-web-1", Name: "web-1", Namespace: "shop"}); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(10 * time.Second)
	for {
		select {
		case err := <-w.errs:
			if status.Code(err) != codes.PermissionDenied {
				continue
			}
		case <-w.updates:
			continue // a rotation that raced the removal
		case <-deadline:
			t.Fatal("no PermissionDenied after the last pod was removed")
		}
		break
	}
	// A pod added again is served to the same watcher.
	add()
	if ids := svidIDs(w.next(t, "after the second AddPod", 10*time.Second)); len(ids) != 1 || ids[0] != want {
		t.Fatalf("SVIDs after the second AddPod = %v", ids)
	}
}

// TestIdentityOff: without --ca-cert the agent serves no Workload API.
func TestIdentityOff(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "wl", "workload.sock")
	c := testConfig(t, "--workload-api-socket", sock)
	ctx, done := runAgent(t, c)
	waitServing(ctx, t, c, done)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("workload api socket with identity off: %v; want it absent", err)
	}
}
