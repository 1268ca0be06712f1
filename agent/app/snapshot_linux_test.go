package app

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/agent/policy"
	"aether.io/node/agent/services"
)

// TestSnapshotRestores: the Services and policies an agent served come
// back from the state directory in a new agent before any API answers;
// an unreadable snapshot is logged and skipped.
func TestSnapshotRestores(t *testing.T) {
	dir := t.TempDir()
	newTestAgent := func() *agent {
		c := &Config{XDSSocket: "unused", ClusterID: "Kubernetes", ClusterDomain: "cluster.local", RootNamespace: "istio-system", StateDir: dir}
		log := slog.New(slog.DiscardHandler)
		return &agent{c: c, nodeRes: newNodeXDS(c, log, services.Metrics{}), log: log}
	}
	a := newTestAgent()
	a.nodeRes.services.UpsertService(&corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"},
		Spec:       corev1.ServiceSpec{ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"}, Ports: []corev1.ServicePort{{Port: 80}}},
	})
	o, err := policy.ParseObject([]byte(`{"metadata":{"name":"deny-batch","namespace":"shop"},"spec":{"action":"DENY","rules":[{"from":[{"source":{"namespaces":["batch"]}}]}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	a.nodeRes.policies.Upsert(o)
	p, err := policy.ParsePeerObject([]byte(`{"metadata":{"name":"strict","namespace":"istio-system"},"spec":{"mtls":{"mode":"STRICT"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	a.nodeRes.policies.UpsertPeer(p)
	if err := a.writeSnapshot(); err != nil {
		t.Fatal(err)
	}

	b := newTestAgent()
	b.restoreSnapshot()
	idx := b.nodeRes.workloads.idx
	if idx.Addresses().Get("shop/web.shop.svc.cluster.local") == nil {
		t.Error("the Service was not restored")
	}
	if idx.Authorizations().Get("shop/deny-batch") == nil || idx.Authorizations().Get("istio-system/"+policy.StaticStrictName) == nil {
		t.Errorf("policies not restored: %d served", idx.Authorizations().Len())
	}

	if err := os.WriteFile(filepath.Join(dir, snapshotFile), []byte("{broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := newTestAgent()
	c.restoreSnapshot()
	if c.nodeRes.services.Len() != 0 {
		t.Error("a broken snapshot restored something")
	}
}
