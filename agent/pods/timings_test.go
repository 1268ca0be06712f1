package pods

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry/local"
)

// webPodStore is a temporary store and a pod source holding the managed
// pod ns/web (uid u1).
func webPodStore(t *testing.T) (*store.Store, *fakeSource) {
	t.Helper()
	st, err := store.Open(t.TempDir(), store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	src := newFakeSource()
	src.set(&podsource.Pod{Namespace: "ns", Name: "web", UID: "u1", NodeName: "n", Labels: map[string]string{ManagedLabel: "true"}})
	return st, src
}

func callTimings(started time.Time, preCall time.Duration) *cniv1.PluginTimings {
	return &cniv1.PluginTimings{Started: timestamppb.New(started), PreCall: durationpb.New(preCall)}
}

// TestPluginTimingsKept follows one pod through ADD (from a plugin without
// timings, then with them), ReportAddResult, DEL and a new sandbox: the
// record holds the last ADD's timings, the manager the last DEL's.
func TestPluginTimingsKept(t *testing.T) {
	ctx := context.Background()
	st, src := webPodStore(t)
	m := New(Config{Node: "n", PodWait: 200 * time.Millisecond}, st, local.New(), src, nil, nil, nil)
	clock := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	m.now = func() time.Time { return clock }
	pod := func(cid string) *cniv1.CNIPod {
		return &cniv1.CNIPod{Namespace: "ns", Name: "web", ContainerId: cid, NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}}
	}
	addT := callTimings(clock, 2*time.Millisecond)
	report := &cniv1.PluginTimings{
		Started: addT.GetStarted(), PreCall: addT.GetPreCall(),
		CaptureDivert: durationpb.New(3 * time.Millisecond), Total: durationpb.New(9 * time.Millisecond),
	}
	delT := callTimings(clock.Add(time.Minute), time.Millisecond)
	lastADD := func(cid string) *cniv1.PluginTimings {
		t.Helper()
		s, ok := m.Get(cid)
		if !ok {
			t.Fatalf("no record of %s", cid)
		}
		return s.Record.LastTimings
	}
	stored := func(cid string) *cniv1.PluginTimings {
		t.Helper()
		r, err := st.Get(cid)
		if err != nil {
			t.Fatal(err)
		}
		return r.LastTimings
	}

	for _, step := range []struct {
		name  string
		do    func() error
		check func(t *testing.T)
	}{
		{
			name: "ADD from a plugin without plugin_timings",
			do:   func() error { _, err := m.AddPod(ctx, pod("c1"), nil); return err },
			check: func(t *testing.T) {
				if got := lastADD("c1"); got != nil {
					t.Errorf("last ADD timings = %v, want none", got)
				}
			},
		},
		{
			name: "ADD with plugin_timings: kept and stored",
			do:   func() error { _, err := m.AddPod(ctx, pod("c1"), addT); return err },
			check: func(t *testing.T) {
				if got := lastADD("c1"); !proto.Equal(got, addT) {
					t.Errorf("last ADD timings = %v, want %v", got, addT)
				}
				if got := stored("c1"); !proto.Equal(got, addT) {
					t.Errorf("stored timings = %v, want %v", got, addT)
				}
			},
		},
		{
			name: "ReportAddResult completes them",
			do: func() error {
				_, err := m.ReportAddResult(ctx, &cniv1.ReportAddResultRequest{ContainerId: "c1", Timings: report})
				return err
			},
			check: func(t *testing.T) {
				if got := lastADD("c1"); !proto.Equal(got, report) {
					t.Errorf("last ADD timings = %v, want %v", got, report)
				}
			},
		},
		{
			name: "re-ADD without plugin_timings keeps them",
			do:   func() error { _, err := m.AddPod(ctx, pod("c1"), nil); return err },
			check: func(t *testing.T) {
				if got := lastADD("c1"); !proto.Equal(got, report) {
					t.Errorf("last ADD timings = %v, want %v", got, report)
				}
			},
		},
		{
			name: "DEL: kept for the pod after its record is gone",
			do:   func() error { _, err := m.RemovePod(ctx, "ns", "web", "c1", delT); return err },
			check: func(t *testing.T) {
				if _, ok := m.Get("c1"); ok {
					t.Fatal("record of c1 survived RemovePod")
				}
				r, ok := m.LastRemoval("ns", "web")
				if !ok || r.ContainerID != "c1" || !r.At.Equal(clock) || !proto.Equal(r.Timings, delT) {
					t.Errorf("last DEL = %+v, %v; want c1 at %v with %v", r, ok, clock, delT)
				}
			},
		},
		{
			name: "a new sandbox of the pod shows the earlier DEL",
			do:   func() error { _, err := m.AddPod(ctx, pod("c2"), addT); return err },
			check: func(t *testing.T) {
				list := m.List()
				if len(list) != 1 || list[0].LastRemoval == nil || list[0].LastRemoval.ContainerID != "c1" ||
					!proto.Equal(list[0].LastRemoval.Timings, delT) {
					t.Errorf("pod states = %+v, want c2 with the DEL of c1", list)
				}
			},
		},
		{
			name: "DEL of a pod the agent never held is not kept",
			do:   func() error { _, err := m.RemovePod(ctx, "ns", "plain", "c9", delT); return err },
			check: func(t *testing.T) {
				if r, ok := m.LastRemoval("ns", "plain"); ok {
					t.Errorf("kept DEL of an unmanaged pod: %+v", r)
				}
			},
		},
		{
			name: "a retried DEL of a removed container replaces it",
			do: func() error {
				clock = clock.Add(time.Second)
				_, err := m.RemovePod(ctx, "ns", "web", "c1", callTimings(clock, 5*time.Millisecond))
				return err
			},
			check: func(t *testing.T) {
				r, _ := m.LastRemoval("ns", "web")
				if r.ContainerID != "c1" || r.Timings.GetPreCall().AsDuration() != 5*time.Millisecond {
					t.Errorf("last DEL = %+v, want the retry's", r)
				}
			},
		},
		{
			name: "kept DELs age out after an hour",
			do: func() error {
				clock = clock.Add(time.Hour + time.Second)
				m.pruneMarks(time.Hour)
				return nil
			},
			check: func(t *testing.T) {
				if r, ok := m.LastRemoval("ns", "web"); ok {
					t.Errorf("DEL older than an hour kept: %+v", r)
				}
			},
		},
	} {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.name, err)
		}
		t.Run(step.name, step.check)
	}
}

// TestRemovalsBounded: at most maxRemovals DELs are kept; the oldest goes.
func TestRemovalsBounded(t *testing.T) {
	m := New(Config{Node: "n"}, nil, local.New(), newFakeSource(), nil, nil, nil)
	clock := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	m.now = func() time.Time { return clock }
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range maxRemovals + 1 {
		clock = clock.Add(time.Millisecond)
		m.keepRemovalLocked("ns", fmt.Sprintf("p-%d", i), "c", nil)
	}
	if len(m.removals) != maxRemovals {
		t.Fatalf("%d DELs kept, want %d", len(m.removals), maxRemovals)
	}
	if _, ok := m.removals["ns/p-0"]; ok {
		t.Fatal("the oldest DEL was kept")
	}
	if _, ok := m.removals[fmt.Sprintf("ns/p-%d", maxRemovals)]; !ok {
		t.Fatal("the newest DEL was dropped")
	}
}
