package workload

import (
	"slices"
	"strings"
	"testing"

	workloadpb "aether.io/node/api/istio/workload"
)

// cacheIndex holds workloads a, b and c under keys ka, kb, kc.
func cacheIndex(t *testing.T) (*Index, map[string]string) {
	t.Helper()
	x := NewIndex()
	versions := map[string]string{}
	for _, n := range []string{"a", "b", "c"} {
		if _, err := x.Upsert("k"+n, &workloadpb.Workload{Uid: n, Name: n, Addresses: [][]byte{{10, 0, 0, n[0]}}}); err != nil {
			t.Fatal(err)
		}
		versions[n] = x.Get(n).Version
	}
	return x, versions
}

func resourceNames(rs []*Resource) []string {
	out := make([]string, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.Name)
	}
	slices.Sort(out)
	return out
}

// TestDeltaResponseSelection: what the index selects for a new delta
// subscription, with and without initial_resource_versions.
func TestDeltaResponseSelection(t *testing.T) {
	_, v := cacheIndex(t)
	for _, tc := range []struct {
		name        string
		subscribe   []string
		known       map[string]string
		wantSent    []string
		wantRemoved []string
	}{
		{name: "wildcard", subscribe: []string{"*"}, wantSent: []string{"a", "b", "c"}},
		{name: "legacy wildcard", wantSent: []string{"a", "b", "c"}},
		{
			name: "wildcard with versions", subscribe: []string{"*"},
			known:    map[string]string{"a": v["a"], "b": "stale", "gone": "x"},
			wantSent: []string{"b", "c"}, wantRemoved: []string{"gone"},
		},
		{name: "named", subscribe: []string{"a", "nope"}, wantSent: []string{"a"}, wantRemoved: []string{"nope"}},
		{name: "named and held", subscribe: []string{"a"}, known: map[string]string{"a": v["a"]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, _ := cacheIndex(t)
			sub, cancel := x.Watch()
			t.Cleanup(cancel)
			added, wild := sub.ApplyDelta(true, tc.subscribe, nil)
			d := x.DeltaResponse(sub, added, wild, KnownMap(tc.known))
			if got := resourceNames(d.Resources); !slices.Equal(got, tc.wantSent) && len(got)+len(tc.wantSent) > 0 {
				t.Errorf("sent %v, want %v", got, tc.wantSent)
			}
			slices.Sort(d.Removed)
			if !slices.Equal(d.Removed, tc.wantRemoved) && len(d.Removed)+len(tc.wantRemoved) > 0 {
				t.Errorf("removed %v, want %v", d.Removed, tc.wantRemoved)
			}
			if d.Revision != x.Revision() {
				t.Errorf("revision %d, want %d", d.Revision, x.Revision())
			}
		})
	}
}

// TestDeltaResponseKnownEntries: a new wildcard whose versions come as
// wire entries (the server codec's form, no map) selects what the map form
// selects, and for a name the wire repeats the last entry counts.
func TestDeltaResponseKnownEntries(t *testing.T) {
	_, v := cacheIndex(t)
	for _, tc := range []struct {
		name        string
		entries     []knownEntry
		wantSent    []string
		wantRemoved []string
	}{
		{name: "all held", entries: []knownEntry{{"a", v["a"]}, {"b", v["b"]}, {"c", v["c"]}}},
		{name: "one stale", entries: []knownEntry{{"a", v["a"]}, {"b", "stale"}, {"c", v["c"]}}, wantSent: []string{"b"}},
		{name: "one missing", entries: []knownEntry{{"a", v["a"]}, {"c", v["c"]}}, wantSent: []string{"b"}},
		{
			name: "gone and stale", entries: []knownEntry{{"gone", "x"}, {"a", "stale"}, {"gone", "y"}},
			wantSent: []string{"a", "b", "c"}, wantRemoved: []string{"gone"},
		},
		{
			name: "repeated names cover nothing more", entries: []knownEntry{{"a", v["a"]}, {"a", v["a"]}, {"b", v["b"]}},
			wantSent: []string{"c"},
		},
		{name: "repeated: last stale", entries: []knownEntry{{"a", v["a"]}, {"a", "stale"}, {"b", v["b"]}, {"c", v["c"]}}, wantSent: []string{"a"}},
		{name: "not a version the index issues", entries: []knownEntry{{"a", "0" + v["a"]}, {"b", strings.ToUpper(v["b"])}, {"c", v["c"]}}, wantSent: []string{"a", "b"}},
		{name: "repeated: last held", entries: []knownEntry{{"a", "stale"}, {"a", v["a"]}, {"b", v["b"]}, {"c", v["c"]}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, _ := cacheIndex(t)
			sub, cancel := x.Watch()
			t.Cleanup(cancel)
			added, wild := sub.ApplyDelta(true, []string{"*"}, nil)
			d := x.DeltaResponse(sub, added, wild, Known{entries: tc.entries})
			if got := resourceNames(d.Resources); !slices.Equal(got, tc.wantSent) && len(got)+len(tc.wantSent) > 0 {
				t.Errorf("sent %v, want %v", got, tc.wantSent)
			}
			slices.Sort(d.Removed)
			if !slices.Equal(d.Removed, tc.wantRemoved) && len(d.Removed)+len(tc.wantRemoved) > 0 {
				t.Errorf("removed %v, want %v", d.Removed, tc.wantRemoved)
			}
		})
	}
}

// TestDeltaResponsePending: changes after the first response are sent to
// the subscriptions that cover them, once, with removals by name.
func TestDeltaResponsePending(t *testing.T) {
	x, _ := cacheIndex(t)
	wild, cancelWild := x.Watch()
	t.Cleanup(cancelWild)
	named, cancelNamed := x.Watch()
	t.Cleanup(cancelNamed)
	added, w := wild.ApplyDelta(true, []string{"*"}, nil)
	x.DeltaResponse(wild, added, w, Known{})
	added, w = named.ApplyDelta(true, []string{"b"}, nil)
	x.DeltaResponse(named, added, w, Known{})

	if _, err := x.Upsert("kd", &workloadpb.Workload{Uid: "d", Addresses: [][]byte{{10, 0, 0, 4}}}); err != nil {
		t.Fatal(err)
	}
	x.Remove("kb")
	for _, sub := range []*Subscription{wild, named} {
		select {
		case <-sub.Changed():
		default:
			t.Fatal("Changed did not fire")
		}
	}
	d := x.DeltaResponse(wild, nil, false, Known{})
	if got := resourceNames(d.Resources); !slices.Equal(got, []string{"d"}) || !slices.Equal(d.Removed, []string{"b"}) || d.Since.IsZero() {
		t.Errorf("wildcard got %v removed %v since %v, want [d] removed [b]", got, d.Removed, d.Since)
	}
	d = x.DeltaResponse(named, nil, false, Known{})
	if len(d.Resources) != 0 || !slices.Equal(d.Removed, []string{"b"}) {
		t.Errorf("named got %v removed %v, want removed [b] only", resourceNames(d.Resources), d.Removed)
	}
	if d := x.DeltaResponse(wild, nil, false, Known{}); len(d.Resources)+len(d.Removed) != 0 {
		t.Errorf("pending changes sent twice: %v %v", resourceNames(d.Resources), d.Removed)
	}
	// Unsubscribing drops the name from later changes.
	named.ApplyDelta(false, nil, []string{"b"})
	if named.Subscribed("b") {
		t.Error("b still subscribed after unsubscribe")
	}
}

// TestSotWSubscription: SotW replaces the subscription per request and
// selects the subscribed resources that exist; wildcard lists are shared.
func TestSotWSubscription(t *testing.T) {
	x, _ := cacheIndex(t)
	sub, cancel := x.Watch()
	t.Cleanup(cancel)
	if !sub.SetSotW(nil) || !sub.Wildcard() {
		t.Fatal("first empty request is not a new wildcard subscription")
	}
	all := x.SotWResponse(sub)
	if got := resourceNames(all.Resources); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("wildcard state %v", got)
	}
	if again := x.SotWResponse(sub); &again.Resources[0] != &all.Resources[0] {
		t.Error("wildcard list rebuilt at the same revision")
	}
	if sub.SetSotW([]string{"*"}) {
		t.Error("same wildcard reported as a change")
	}
	if !sub.SetSotW([]string{"c", "nope"}) {
		t.Error("new names not reported as a change")
	}
	if got := resourceNames(x.SotWResponse(sub).Resources); !slices.Equal(got, []string{"c"}) {
		t.Errorf("named state %v, want [c]", got)
	}
	x.Remove("ka")
	if hit, _ := sub.TakeChanged(); hit {
		t.Error("change of an unsubscribed name reported")
	}
	x.Remove("kc")
	if hit, since := sub.TakeChanged(); !hit || since.IsZero() {
		t.Error("change of a subscribed name not reported")
	}
}
