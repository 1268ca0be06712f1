package pods

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// records lists st's records.
func records(t *testing.T, st *store.Store) []*store.Record {
	t.Helper()
	recs, err := st.List()
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// countingObserver counts RecordStored calls (what the identity loop and
// the xDS resources follow: an SVID is minted only for a stored record).
type countingObserver struct{ stored int }

func (o *countingObserver) RecordStored(*store.Record, registry.Endpoint) { o.stored++ }
func (o *countingObserver) RecordRemoved(string)                          {}

// TestAddPodOtherNodeRefused: a pod the source knows but whose
// spec.nodeName is another node, or empty (not scheduled yet), is refused
// with ErrPodOtherNode naming the pod, its nodeName and this node, and
// leaves no record, no registry endpoint and nothing for the observers (no
// SVID); a pod of this node is added.
func TestAddPodOtherNodeRefused(t *testing.T) {
	managed := map[string]string{ManagedLabel: "true"}
	for _, tc := range []struct {
		name, nodeName string
		// labels of the source's pod; an unmanaged pod is refused too.
		labels  map[string]string
		wantErr bool
	}{
		{name: "another node", nodeName: "other", labels: managed, wantErr: true},
		{name: "not scheduled", nodeName: "", labels: managed, wantErr: true},
		{name: "another node, unmanaged", nodeName: "other", wantErr: true},
		{name: "this node", nodeName: "n", labels: managed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st, err := store.Open(t.TempDir(), store.Options{NoSync: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			reg := local.New()
			src := newFakeSource()
			src.set(&podsource.Pod{Namespace: "shop", Name: "web-1", UID: "uid-1", NodeName: tc.nodeName, Labels: tc.labels})
			healthy := true
			obs := &countingObserver{}
			m := New(Config{Node: "n", PodWait: 200 * time.Millisecond, Observer: obs}, st, reg, src, alwaysHealthy{&healthy}, nil, nil)
			res, err := m.AddPod(ctx, &cniv1.CNIPod{
				Namespace: "shop", Name: "web-1", ContainerId: "cid-1", NetworkNamespace: "/x", Ips: []string{"10.0.0.2"},
			}, nil)
			eps, lerr := reg.List(ctx)
			if lerr != nil {
				t.Fatal(lerr)
			}
			if !tc.wantErr {
				if err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS || len(records(t, st)) != 1 || len(eps) != 1 || obs.stored == 0 {
					t.Fatalf("AddPod = %v, %v; records %d, endpoints %d, stored %d; want success, 1, 1, >0", res, err, len(records(t, st)), len(eps), obs.stored)
				}
				return
			}
			if !errors.Is(err, ErrPodOtherNode) || res != cniv1.AddPodResponse_RESULT_ERROR {
				t.Fatalf("AddPod = %v, %v; want RESULT_ERROR, ErrPodOtherNode", res, err)
			}
			for _, w := range []string{"shop/web-1", `spec.nodeName is "` + tc.nodeName + `"`, `this node is "n"`} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if len(records(t, st)) != 0 || len(eps) != 0 || obs.stored != 0 {
				t.Fatalf("refused pod left %d records, %d endpoints, %d observer calls; want none", len(records(t, st)), len(eps), obs.stored)
			}
			if _, ok := m.Get("cid-1"); ok {
				t.Fatal("refused pod is held by the manager")
			}
		})
	}
}

// TestAddPodManifestsNodeName: with the pod-manifests source, a manifest
// without spec.nodeName is this node's (the source's convention, as for
// static pods) and is added; one naming another node is never this node's
// pod and is not added.
func TestAddPodManifestsNodeName(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	manifest := func(name, nodeName string) string {
		s := "apiVersion: v1\nkind: Pod\nmetadata:\n  name: " + name + "\n  namespace: shop\n  uid: uid-" + name + "\n  labels:\n    " + ManagedLabel + ": \"true\"\nspec:\n"
		if nodeName != "" {
			s += "  nodeName: \"" + nodeName + "\"\n"
		}
		return s + "  containers: [{name: c, image: pause}]\n"
	}
	for name, node := range map[string]string{"mine": "", "theirs": "other"} {
		if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(manifest(name, node)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	st, err := store.Open(t.TempDir(), store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	healthy := true
	m := New(Config{Node: "n", PodWait: 200 * time.Millisecond}, st, local.New(), manifests.New(dir, "n", time.Hour, nil), alwaysHealthy{&healthy}, nil, nil)
	add := func(name string) (cniv1.AddPodResponse_Result, error) {
		return m.AddPod(ctx, &cniv1.CNIPod{Namespace: "shop", Name: name, ContainerId: "cid-" + name, NetworkNamespace: "/x", Ips: []string{"10.0.0.3"}}, nil)
	}
	if res, err := add("mine"); err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod of a manifest without nodeName = %v, %v; want success", res, err)
	}
	if res, err := add("theirs"); err == nil || res != cniv1.AddPodResponse_RESULT_ERROR {
		t.Fatalf("AddPod of another node's manifest = %v, %v; want refused", res, err)
	}
	if recs := records(t, st); len(recs) != 1 || recs[0].Pod.GetName() != "mine" || recs[0].Node != "n" {
		t.Fatalf("records %v; want only shop/mine on node n", recs)
	}
}
