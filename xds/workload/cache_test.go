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

// knownEntry is one initial_resource_versions entry of a test.
type knownEntry struct{ name, version string }

// knownEntries is the Known of entries in this order, as the server's codec
// hands it over.
func knownEntries(entries []knownEntry) Known {
	var b []byte
	for _, e := range entries {
		b = appendKnownEntry(b, e.name, e.version)
	}
	return Known{wire: b, n: len(entries)}
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
			d := x.DeltaResponse(sub, added, wild, knownEntries(tc.entries))
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

// TestSelectKnownAnyOrder: the selection of a reconnect does not depend on
// the order of its entries. A client that kept the full state in the order
// it came (slot order) takes the in-order path of selectKnown; reversed and
// shuffled entries take the map path; entries whose neighbour changed,
// vanished or reused a slot mix both. Every order selects the same.
func TestSelectKnownAnyOrder(t *testing.T) {
	x := NewIndex()
	fill(t, x, 40)
	sub, cancel := x.Watch()
	t.Cleanup(cancel)
	added, wild := sub.ApplyDelta(true, []string{"*"}, nil)
	full := x.DeltaResponse(sub, added, wild, Known{})
	// The full state comes in slot order: the order the names were first served.
	for i, r := range full.Resources {
		if want := UID("Kubernetes", "shop", endpointN(i).Name); r.Name != want {
			t.Fatalf("full state entry %d is %s, want %s (slot order)", i, r.Name, want)
		}
	}
	held := make([]knownEntry, 0, len(full.Resources))
	for _, r := range full.Resources {
		held = append(held, knownEntry{r.Name, r.Version})
	}
	// While the client is away: 3 change, 5 is removed (its slot goes to
	// a new workload), 7 is removed for good.
	for _, i := range []int{3, 5, 7} {
		x.Remove(endpointN(i).Key)
	}
	for _, i := range []int{3, 40} {
		ep := endpointN(i)
		ep.ServiceAccount = "changed"
		w, err := Build(testConfig, ep)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
	}
	uid := func(i int) string { return UID("Kubernetes", "shop", endpointN(i).Name) }
	wantSent := []string{uid(3), uid(40)}
	slices.Sort(wantSent)
	wantRemoved := []string{uid(5), uid(7)}
	slices.Sort(wantRemoved)
	reversed := slices.Clone(held)
	slices.Reverse(reversed)
	shuffled := slices.Clone(held)
	for i := range shuffled { // a fixed permutation: i → 17i mod n
		shuffled[i] = held[(17*i)%len(held)]
	}
	stale := slices.Clone(held)
	stale[10].version = "stale" // its in-order neighbour 11 must still be found
	for _, tc := range []struct {
		name     string
		entries  []knownEntry
		wantSent []string
	}{
		{name: "in order", entries: held, wantSent: wantSent},
		{name: "reversed", entries: reversed, wantSent: wantSent},
		{name: "shuffled", entries: shuffled, wantSent: wantSent},
		{name: "in order, one stale", entries: stale, wantSent: slices.Sorted(slices.Values(append([]string{uid(10)}, wantSent...)))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sub, cancel := x.Watch()
			t.Cleanup(cancel)
			added, wild := sub.ApplyDelta(true, []string{"*"}, nil)
			d := x.DeltaResponse(sub, added, wild, knownEntries(tc.entries))
			if got := resourceNames(d.Resources); !slices.Equal(got, tc.wantSent) {
				t.Errorf("sent %v, want %v", got, tc.wantSent)
			}
			slices.Sort(d.Removed)
			if !slices.Equal(d.Removed, wantRemoved) {
				t.Errorf("removed %v, want %v", d.Removed, wantRemoved)
			}
		})
	}
}
