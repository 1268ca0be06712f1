package adsclient_test

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"aether.io/node/xds/adsclient"
)

// sent is what the request v makes decodes to with the standard proto
// codec, and the order of its initial_resource_versions entries.
func sent(t *testing.T, v *adsclient.Versions, req *discovery.DeltaDiscoveryRequest) (*discovery.DeltaDiscoveryRequest, []string) {
	t.Helper()
	enc, err := v.Request(req)
	if err != nil {
		t.Fatal(err)
	}
	data, err := adsclient.Codec().Marshal(enc)
	if err != nil {
		t.Fatal(err)
	}
	b := data.Materialize()
	got := &discovery.DeltaDiscoveryRequest{}
	if err := proto.Unmarshal(b, got); err != nil {
		t.Fatal(err)
	}
	var order []string
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if num == 5 {
			entry, _ := protowire.ConsumeBytes(b)
			_, _, n := protowire.ConsumeTag(entry)
			name, _ := protowire.ConsumeBytes(entry[n:])
			order = append(order, string(name))
		}
		b = b[m:]
	}
	return got, order
}

// TestVersions: after any sequence of sets and deletes, the request
// carries exactly the versions held, in the order they were last set, and
// every other field of the request; a request made earlier keeps its bytes
// while the versions change and compact.
func TestVersions(t *testing.T) {
	type op struct {
		name, version string // version "": delete
	}
	many := func(rounds int) []op {
		var ops []op
		for r := range rounds {
			for i := range 50 {
				ops = append(ops, op{fmt.Sprintf("w-%02d", i), fmt.Sprintf("v%d", r)})
			}
			ops = append(ops, op{name: fmt.Sprintf("w-%02d", r)})
		}
		return ops
	}
	tests := []struct {
		name      string
		ops       []op
		wantOrder []string
	}{
		{name: "empty"},
		{name: "in order", ops: []op{{"a", "1"}, {"b", "2"}, {"c", "3"}}, wantOrder: []string{"a", "b", "c"}},
		{name: "same version keeps its place", ops: []op{{"a", "1"}, {"b", "2"}, {"a", "1"}}, wantOrder: []string{"a", "b"}},
		{name: "changed moves to the end", ops: []op{{"a", "1"}, {"b", "2"}, {"c", "3"}, {"a", "4"}}, wantOrder: []string{"b", "c", "a"}},
		{name: "deleted", ops: []op{{"a", "1"}, {"b", "2"}, {"c", "3"}, {name: "b"}, {name: "nope"}}, wantOrder: []string{"a", "c"}},
		{name: "deleted and set again", ops: []op{{"a", "1"}, {"b", "2"}, {name: "a"}, {"a", "1"}}, wantOrder: []string{"b", "a"}},
		{name: "empty name and version", ops: []op{{"", "1"}, {"x", "2"}}, wantOrder: []string{"", "x"}},
		{name: "compacted", ops: many(4)},
	}
	req := &discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: "n1"}, TypeUrl: "t", ResourceNamesSubscribe: []string{"*"}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := &adsclient.Versions{}
			want := map[string]string{}
			type snapshot struct {
				enc  *adsclient.EncodedRequest // aliases what v held then
				want map[string]string
			}
			var earlier []snapshot
			for i, o := range tt.ops {
				if o.version == "" {
					v.Delete(o.name)
					delete(want, o.name)
				} else {
					v.Set(o.name, o.version)
					want[o.name] = o.version
				}
				if i%20 == 0 {
					enc, err := v.Request(req)
					if err != nil {
						t.Fatal(err)
					}
					earlier = append(earlier, snapshot{enc, maps.Clone(want)})
				}
			}
			got, order := sent(t, v, req)
			if len(want) > 0 && !maps.Equal(got.GetInitialResourceVersions(), want) {
				t.Errorf("sent versions %v, want %v", got.GetInitialResourceVersions(), want)
			}
			if v.Len() != len(want) || !maps.Equal(v.Map(), want) {
				t.Errorf("holds %v, want %v", v.Map(), want)
			}
			got.InitialResourceVersions = nil
			if !proto.Equal(got, req) {
				t.Errorf("sent %v, want %v", got, req)
			}
			if tt.wantOrder != nil && !slices.Equal(order, tt.wantOrder) {
				t.Errorf("sent in order %v, want %v", order, tt.wantOrder)
			}
			for _, s := range earlier {
				data, err := adsclient.Codec().Marshal(s.enc)
				if err != nil {
					t.Fatal(err)
				}
				dec := &discovery.DeltaDiscoveryRequest{}
				if err := proto.Unmarshal(data.Materialize(), dec); err != nil {
					t.Fatal(err)
				}
				if len(s.want) > 0 && !maps.Equal(dec.GetInitialResourceVersions(), s.want) {
					t.Errorf("an earlier request changed: %v, want %v", dec.GetInitialResourceVersions(), s.want)
				}
			}
		})
	}
}
