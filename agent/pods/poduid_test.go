package pods

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry/local"
)

// TestAddPodUID: a StatefulSet pod deleted and re-created under the same
// name while the pod source's cache still holds the old one. A request
// carrying the new pod's uid never records the old uid or its terminating
// mark: it is re-fetched once, and refused (retryable) if the source still
// disagrees. A request without uid keeps the old behaviour.
func TestAddPodUID(t *testing.T) {
	const oldUID, newUID = "uid-old", "uid-new"
	managed := map[string]string{ManagedLabel: "true"}
	oldPod := &podsource.Pod{Namespace: "ns", Name: "db-0", UID: oldUID, NodeName: "n", Labels: managed, Terminating: true}
	newPod := &podsource.Pod{Namespace: "ns", Name: "db-0", UID: newUID, NodeName: "n", Labels: managed}
	for _, tc := range []struct {
		name string
		// cached is what the source's cache answers, authority what Fetch
		// reads (nil: not found).
		cached, authority *podsource.Pod
		// uid is the request's K8S_POD_UID.
		uid string
		// wantErr means AddPod must fail with ErrPodUIDMismatch and
		// record nothing; else the record must carry wantUID.
		wantErr         bool
		wantUID         string
		wantTerminating bool
		wantFetches     int
	}{
		{name: "mismatch, authority still old", cached: oldPod, authority: oldPod, uid: newUID, wantErr: true, wantFetches: 1},
		{name: "mismatch, authority has no pod", cached: oldPod, uid: newUID, wantErr: true, wantFetches: 1},
		{name: "mismatch, re-fetch finds the new pod", cached: oldPod, authority: newPod, uid: newUID, wantUID: newUID, wantFetches: 1},
		{name: "match", cached: newPod, authority: newPod, uid: newUID, wantUID: newUID},
		{name: "no uid: cached pod taken as before", cached: oldPod, authority: newPod, wantUID: oldUID, wantTerminating: true},
		// A source without uids (manifests) cannot tell the pods apart:
		// today's behaviour stays (any terminating mark of the name applies).
		{name: "source pod without uid", cached: &podsource.Pod{Namespace: "ns", Name: "db-0", NodeName: "n", Labels: managed}, uid: newUID, wantTerminating: true},
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
			src.cached = map[string]*podsource.Pod{tc.cached.ID(): tc.cached}
			if tc.authority != nil {
				src.set(tc.authority)
			}
			healthy := true
			m := New(Config{Node: "n", PodWait: 200 * time.Millisecond}, st, reg, src, alwaysHealthy{&healthy}, nil, nil)
			// The watch saw the old pod's deletionTimestamp.
			m.Handler(ctx).OnPod(oldPod)

			res, err := m.AddPod(ctx, &cniv1.CNIPod{
				Namespace: "ns", Name: "db-0", Uid: tc.uid, ContainerId: "sandbox-2",
				NetworkNamespace: "/x", Ips: []string{"10.0.0.2"},
			}, nil)
			if src.fetches != tc.wantFetches {
				t.Errorf("Fetch called %d times, want %d", src.fetches, tc.wantFetches)
			}
			if tc.wantErr {
				if !errors.Is(err, ErrPodUIDMismatch) || res != cniv1.AddPodResponse_RESULT_ERROR {
					t.Fatalf("AddPod = %v, %v; want RESULT_ERROR, ErrPodUIDMismatch", res, err)
				}
				if !strings.Contains(err.Error(), oldUID) || !strings.Contains(err.Error(), newUID) {
					t.Errorf("error %q does not name both uids", err)
				}
				if _, ok := m.Get("sandbox-2"); ok {
					t.Error("refused pod has a record")
				}
				if recs, err := st.List(); err != nil || len(recs) != 0 {
					t.Errorf("store holds %d records (%v) after a refused AddPod", len(recs), err)
				}
				if eps, _ := reg.List(ctx); len(eps) != 0 {
					t.Errorf("refused pod registered: %v", eps)
				}
				return
			}
			if err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
				t.Fatalf("AddPod = %v, %v; want RESULT_SUCCESS", res, err)
			}
			s, ok := m.Get("sandbox-2")
			if !ok {
				t.Fatal("no record after AddPod")
			}
			if got := s.Record.Pod.GetUid(); got != tc.wantUID {
				t.Errorf("recorded uid %q, want %q", got, tc.wantUID)
			}
			if got := s.Record.Pod.GetTerminating(); got != tc.wantTerminating {
				t.Errorf("recorded terminating %v, want %v", got, tc.wantTerminating)
			}
			if s.Registered == tc.wantTerminating {
				t.Errorf("registered %v with terminating %v", s.Registered, tc.wantTerminating)
			}
			recs, err := st.List()
			if err != nil || len(recs) != 1 || recs[0].Pod.GetUid() != tc.wantUID {
				t.Errorf("stored records %v (%v), want one with uid %q", recs, err, tc.wantUID)
			}
		})
	}
}

// BenchmarkAddPodUID is AddPod of a managed pod with the store and the
// in-memory source: without a uid (today's path), with the source's uid
// (the check costs a comparison), and with a uid the cache lacks so the
// pod is fetched again (one extra source call).
func BenchmarkAddPodUID(b *testing.B) {
	managed := map[string]string{ManagedLabel: "true"}
	oldPod := &podsource.Pod{Namespace: "ns", Name: "db-0", UID: "uid-old", NodeName: "n", Labels: managed}
	newPod := &podsource.Pod{Namespace: "ns", Name: "db-0", UID: "uid-new", NodeName: "n", Labels: managed}
	for _, bc := range []struct {
		name   string
		cached *podsource.Pod
		uid    string
	}{
		{"no_uid", newPod, ""},
		{"uid_match", newPod, "uid-new"},
		{"uid_mismatch_refetch", oldPod, "uid-new"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			st, err := store.Open(b.TempDir(), store.Options{NoSync: true})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { st.Close() })
			src := newFakeSource()
			src.cached = map[string]*podsource.Pod{bc.cached.ID(): bc.cached}
			src.set(newPod)
			m := New(Config{Node: "n"}, st, local.New(), src, nil, nil, nil)
			in := &cniv1.CNIPod{Namespace: "ns", Name: "db-0", Uid: bc.uid, ContainerId: "sandbox", NetworkNamespace: "/x", Ips: []string{"10.0.0.2"}}
			ctx := context.Background()
			for b.Loop() {
				if res, err := m.AddPod(ctx, in, nil); err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
					b.Fatalf("AddPod = %v, %v", res, err)
				}
			}
		})
	}
}
