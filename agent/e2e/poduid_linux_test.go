package e2e

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	cniv1 "aether.io/node/api/aether/cni/v1"
)

// watchGate holds back the bytes of watch streams while frozen.
type watchGate struct {
	mu     sync.Mutex
	cond   *sync.Cond
	frozen bool
}

func newWatchGate() *watchGate {
	g := &watchGate{}
	g.cond = sync.NewCond(&g.mu)
	return g
}

func (g *watchGate) set(frozen bool) {
	g.mu.Lock()
	g.frozen = frozen
	g.mu.Unlock()
	g.cond.Broadcast()
}

func (g *watchGate) wait() {
	g.mu.Lock()
	for g.frozen {
		g.cond.Wait()
	}
	g.mu.Unlock()
}

// gatedBody passes a watch stream's bytes on only while the gate is open.
type gatedBody struct {
	io.ReadCloser
	g *watchGate
}

func (b gatedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.g.wait()
	return n, err
}

type gatedTransport struct {
	rt http.RoundTripper
	g  *watchGate
}

func (t gatedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.rt.RoundTrip(r)
	if err == nil && r.URL.Query().Get("watch") == "true" {
		resp.Body = gatedBody{ReadCloser: resp.Body, g: t.g}
	}
	return resp, err
}

// lagProxy serves the API of cfg on loopback (plain HTTP, credentials
// added by the proxy) and returns a kubeconfig for it and the gate that
// makes every watch through it lag: while frozen, lists and GETs are
// answered but no watch event reaches the client (an informer that lags).
func lagProxy(t *testing.T, cfg *rest.Config) (kubeconfig string, g *watchGate) {
	t.Helper()
	rt, err := rest.TransportFor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	target, err := url.Parse(cfg.Host)
	if err != nil {
		t.Fatal(err)
	}
	g = newWatchGate()
	p := &httputil.ReverseProxy{
		Rewrite:       func(r *httputil.ProxyRequest) { r.SetURL(target) },
		Transport:     gatedTransport{rt: rt, g: g},
		FlushInterval: -1,
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() {
		g.set(false)
		_ = srv.Close()
	})
	kubeconfig = filepath.Join(t.TempDir(), "kubeconfig")
	body := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: lag, cluster: {server: "http://%s"}}]
users: [{name: lag, user: {}}]
contexts: [{name: lag, context: {cluster: lag, user: lag}}]
current-context: lag
`, l.Addr())
	if err := os.WriteFile(kubeconfig, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return kubeconfig, g
}

// TestKubernetesPodRecreatedSameName is issue 12 against a real
// kube-apiserver: a StatefulSet-style pod is deleted and re-created under
// the same name while the agent's informer lags (its watch is held back),
// so the cache still has the old pod, with its deletionTimestamp. The
// runtime's ADD of the new sandbox carries the new pod's uid
// (K8S_POD_UID): the agent must fetch the pod again and record the NEW uid,
// not terminating and registered; an ADD whose uid the API server does not
// have either is refused with Unavailable (CNI code 11) and not recorded.
func TestKubernetesPodRecreatedSameName(t *testing.T) {
	cl := startKube(t)
	kubeconfig, gate := lagProxy(t, cl.Config)
	ctx := ctxT(t, 2*time.Minute)
	pods := cl.Client.CoreV1().Pods("shop")
	old, err := pods.Create(ctx, kubePod("db-0", true, "node-a"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	a := startAgent(t, newAgentDirs(t), "--kubeconfig", kubeconfig, "--liveness-interval", "100ms")
	a.waitReady(t)
	c := a.client(t)
	oldReq := cniPod("shop", "db-0", "cid-db-0-old", "10.2.1.5")
	oldReq.Uid = string(old.UID)
	if r, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: oldReq}); err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod old db-0 = %v, %v", r, err)
	}

	// Graceful delete: the informer sees the deletionTimestamp.
	grace := int64(30)
	if err := pods.Delete(ctx, "db-0", metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "old db-0 terminating", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-db-0-old"})
		return err == nil && g.GetPod().GetTerminating()
	})

	// The informer lags from here: the old pod goes, a new one of the same
	// name comes, and the cache still holds the old one.
	gate.set(true)
	zero := int64(0)
	if err := pods.Delete(ctx, "db-0", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	created, err := pods.Create(ctx, kubePod("db-0", true, "node-a"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if created.UID == old.UID {
		t.Fatalf("re-created pod kept uid %s", old.UID)
	}

	newReq := cniPod("shop", "db-0", "cid-db-0-new", "10.2.1.6")
	newReq.Uid = string(created.UID)
	if r, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: newReq}); err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod new db-0 = %v, %v", r, err)
	}
	g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-db-0-new"})
	if err != nil {
		t.Fatal(err)
	}
	if g.GetPod().GetUid() != string(created.UID) || g.GetPod().GetTerminating() || !g.GetRegistered() {
		t.Fatalf("new db-0 recorded with uid %q terminating=%v registered=%v; want uid %q (not the old %q), not terminating, registered",
			g.GetPod().GetUid(), g.GetPod().GetTerminating(), g.GetRegistered(), created.UID, old.UID)
	}

	// A uid the API server does not have either: refused, retryable, and
	// nothing recorded.
	const bogus = "00000000-0000-4000-8000-00000000dead"
	badReq := cniPod("shop", "db-0", "cid-db-0-bogus", "10.2.1.7")
	badReq.Uid = bogus
	_, err = c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: badReq})
	if msg := status.Convert(err).Message(); status.Code(err) != codes.Unavailable || !strings.Contains(msg, bogus) || !strings.Contains(msg, string(old.UID)) {
		t.Fatalf("AddPod with a uid nobody has = %v; want Unavailable naming %s and %s", err, bogus, old.UID)
	}
	if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-db-0-bogus"}); status.Code(err) != codes.NotFound {
		t.Fatalf("refused AddPod left a record: %v", err)
	}

	// The informer catches up: the old pod's delete must not mark the new
	// sandbox, and the new pod's changes follow.
	gate.set(false)
	p, err := pods.Get(ctx, "db-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Labels["version"] = "v2"
	if _, err := pods.Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "label of the new db-0 on its record", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-db-0-new"})
		return err == nil && g.GetPod().GetLabels()["version"] == "v2"
	})
	g, err = c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-db-0-new"})
	if err != nil || g.GetPod().GetTerminating() || !g.GetRegistered() || g.GetPod().GetUid() != string(created.UID) {
		t.Fatalf("new db-0 after the informer caught up = %v, %v", g, err)
	}
	a.terminate(t)
}
