package workload

import (
	"context"
	"errors"
	"slices"
	"testing"

	"aether.io/node/registry"
)

// build is Build for a test endpoint that must form a workload.
func build(t *testing.T, ep registry.Endpoint) *Resource {
	t.Helper()
	w, err := Build(testConfig, ep)
	if err != nil {
		t.Fatal(err)
	}
	r, err := NewResource(w)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestIndexSourcesCannotEraseEachOther: a key belongs to the source that
// put it; another source can neither replace nor remove it, lists only its
// own keys, and a uid claimed through two sources falls back to the
// remaining claimant when the newest one goes.
func TestIndexSourcesCannotEraseEachOther(t *testing.T) {
	x := NewIndex()
	local, remote := x.Writer("local"), x.Writer(FollowerSource)
	own := endpointN(1)
	w, err := Build(testConfig, own)
	if err != nil {
		t.Fatal(err)
	}
	if changed, err := local.Upsert(own.Key, w); err != nil || !changed {
		t.Fatalf("local Upsert = %v, %v", changed, err)
	}
	uid := w.GetUid()
	served := x.Get(uid)

	if _, err := remote.Upsert(own.Key, w); !errors.Is(err, ErrNotOwner) {
		t.Errorf("remote Upsert of a local key = %v, want ErrNotOwner", err)
	}
	if remote.Remove(own.Key) || x.Get(uid) != served {
		t.Error("remote Remove of a local key removed or changed it")
	}
	if keys := remote.Keys(); len(keys) != 0 {
		t.Errorf("remote Keys = %v, want none", keys)
	}
	if keys := local.Keys(); !slices.Equal(keys, []string{own.Key}) {
		t.Errorf("local Keys = %v, want [%s]", keys, own.Key)
	}

	// The same pod under another key from the registry (a stale entry of
	// the node it ran on before) is served while newest; when it goes, the
	// local claim is served again rather than nothing.
	other := own
	other.Key, other.Node, other.Healthy = "elsewhere", "node-b", false
	ow, err := Build(testConfig, other)
	if err != nil {
		t.Fatal(err)
	}
	if changed, err := remote.Upsert(other.Key, ow); err != nil || !changed {
		t.Fatalf("remote Upsert of the same uid = %v, %v", changed, err)
	}
	if x.Get(uid).Version == served.Version {
		t.Error("the newest claimant is not served")
	}
	if !remote.Remove(other.Key) {
		t.Error("removing the served remote claimant reported no change")
	}
	if got := x.Get(uid); got == nil || got.Version != served.Version {
		t.Errorf("after the remote claimant left, served %v, want the local version %s", got, served.Version)
	}
	if !local.Remove(own.Key) || x.Len() != 0 {
		t.Errorf("local Remove left %d workloads", x.Len())
	}
}

// listRegistry is a registry whose List and Watch hold a fixed set.
type listRegistry struct {
	registry.Registry
	eps []registry.Endpoint
}

func (l listRegistry) List(context.Context) ([]registry.Endpoint, error) { return l.eps, nil }

func (l listRegistry) Watch(ctx context.Context) (<-chan registry.Event, error) {
	ch := make(chan registry.Event)
	go func() { <-ctx.Done(); close(ch) }()
	return ch, nil
}

// TestFollowerReconcileKeepsOtherSources: the follower's first sync removes
// the keys it put that the registry lacks, never another source's.
func TestFollowerReconcileKeepsOtherSources(t *testing.T) {
	x := NewIndex()
	own := build(t, endpointN(1))
	if _, err := x.upsertResource("local", endpointN(1).Key, own); err != nil {
		t.Fatal(err)
	}
	gone := endpointN(2)
	if changed, _ := x.upsertResource(FollowerSource, gone.Key, build(t, gone)); !changed {
		t.Fatal("follower-owned key not added")
	}
	f := NewFollower(listRegistry{eps: []registry.Endpoint{endpointN(3)}}, testConfig, x, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-f.Synced()
	if x.Get(own.Name) == nil {
		t.Error("the follower's first sync removed another source's workload")
	}
	if x.Get(build(t, gone).Name) != nil {
		t.Error("the follower's own key missing from the registry is still served")
	}
	if x.Get(build(t, endpointN(3)).Name) == nil {
		t.Error("the registry's endpoint is not served")
	}
}
