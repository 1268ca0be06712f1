package workload

import (
	"maps"
	"slices"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"aether.io/node/xds/resource"
)

func TestDecodeDeltaRequestMatchesProto(t *testing.T) {
	reqs := []*discovery.DeltaDiscoveryRequest{
		{},
		{TypeUrl: resource.WorkloadType, ResourceNamesSubscribe: []string{"*"}},
		{
			Node:                     &core.Node{Id: "n1", Cluster: "c"},
			TypeUrl:                  resource.WorkloadType,
			ResourceNamesSubscribe:   []string{"a", "b"},
			ResourceNamesUnsubscribe: []string{"c"},
			InitialResourceVersions: map[string]string{
				"a": "1", "b": "", "": "x", "c//Pod/ns/ü": "ffee",
				strings.Repeat("long-", 40): "entry over 128 bytes", "v": strings.Repeat("9", 200),
			},
			ResponseNonce: "7",
			ErrorDetail:   &status.Status{Code: 3, Message: "bad"},
		},
	}
	for _, want := range reqs {
		b, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		got := &discovery.DeltaDiscoveryRequest{}
		if err := newCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, got); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(got, want) {
			t.Errorf("decoded\n %v\nwant\n %v", got, want)
		}
		// As the server receives it: versions as entries with our codec,
		// in the embedded message's map with the stock one.
		for name, c := range map[string]encoding.CodecV2{"ours": newCodec(), "stock": encoding.GetCodecV2("proto")} {
			dr := &deltaRequest{DeltaDiscoveryRequest: &discovery.DeltaDiscoveryRequest{}}
			if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, dr); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			k := dr.versions()
			if len(want.GetInitialResourceVersions()) > 0 && !maps.Equal(k.asMap(), want.GetInitialResourceVersions()) {
				t.Errorf("%s: versions %v, want %v", name, k.asMap(), want.GetInitialResourceVersions())
			}
			dr.release()
			dr.InitialResourceVersions = want.GetInitialResourceVersions()
			if !proto.Equal(dr.DeltaDiscoveryRequest, want) {
				t.Errorf("%s: decoded\n %v\nwant\n %v", name, dr.DeltaDiscoveryRequest, want)
			}
		}
	}
	// Truncated input is an error, not a panic.
	b, _ := proto.Marshal(reqs[2])
	for i := 1; i < len(b); i += 7 {
		_ = decodeDeltaRequest(b[:i], &discovery.DeltaDiscoveryRequest{})
	}
	if err := decodeDeltaRequest(b[:len(b)-1], &discovery.DeltaDiscoveryRequest{}); err == nil {
		t.Error("truncated request decoded without error")
	}
}

func TestPreEncodedResourceMatchesProto(t *testing.T) {
	x := NewIndex()
	fill(t, x, 2)
	for _, r := range []*Resource{x.Get(UID("Kubernetes", "shop", endpointN(0).Name)), x.Get(UID("Kubernetes", "shop", endpointN(1).Name))} {
		// Delta: a response made of the pre-encoded field decodes to the typed resource.
		var resp discovery.DeltaDiscoveryResponse
		if err := proto.Unmarshal(slices.Concat(r.appendDelta(nil)...), &resp); err != nil {
			t.Fatal(err)
		}
		if len(resp.GetResources()) != 1 || !proto.Equal(resp.GetResources()[0], r.Delta()) {
			t.Fatalf("delta wire decodes to %v, want %v", resp.GetResources(), r.Delta())
		}
		var sotw discovery.DiscoveryResponse
		if err := proto.Unmarshal(slices.Concat(r.appendSotW(nil)...), &sotw); err != nil {
			t.Fatal(err)
		}
		if len(sotw.GetResources()) != 1 || !proto.Equal(sotw.GetResources()[0], &anypb.Any{TypeUrl: resource.WorkloadType, Value: r.Body}) {
			t.Fatalf("sotw wire decodes to %v", sotw.GetResources())
		}
		// The body is the deterministic encoding of the workload (uid = field 20).
		if num, _, n := protowire.ConsumeTag(r.Body); n < 0 || num == 0 {
			t.Fatal("body does not start with a field")
		}
		if w := parseWire(t, r.Body); w.str(20) != r.Name {
			t.Errorf("body uid %q, want %q", w.str(20), r.Name)
		}
	}
	// The codec sends a preEncoded message as its parts, others with proto.
	msg := &discovery.DeltaDiscoveryResponse{Nonce: "1"}
	c := newCodec()
	plain, err := c.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := proto.Marshal(msg)
	if string(plain.Materialize()) != string(want) {
		t.Error("unregistered message not marshalled by proto")
	}
	got, err := c.Marshal(&preEncoded{Message: msg, parts: [][]byte{[]byte("ab"), nil, []byte("cd")}})
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Materialize()) != "abcd" {
		t.Errorf("registered message sent as %q", got.Materialize())
	}
}

func TestParseVersion(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"0", 0, true},
		{"f", 15, true},
		{"1a2b3c4d5e6f7089", 0x1a2b3c4d5e6f7089, true},
		{"ffffffffffffffff", 1<<64 - 1, true},
		{"", 0, false},
		{"01", 0, false},                // leading zero: never issued
		{"1ffffffffffffffff", 0, false}, // 17 digits
		{"A", 0, false},                 // upper case: never issued
		{"g", 0, false},
		{"1 ", 0, false},
		{"\x00", 0, false},
	} {
		got, ok := parseVersion([]byte(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseVersion(%q) = %x, %v; want %x, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

// TestTypedResponseOnlyForOtherCodecs: our codec sends a preEncoded
// response as its parts and never builds its typed message; any other
// codec (the stock proto codec) builds it once and marshals it, to the
// same message; a resource's frame is laid out at its first send only.
func TestTypedResponseOnlyForOtherCodecs(t *testing.T) {
	x := NewIndex()
	fill(t, x, 1)
	r := x.Get(UID("Kubernetes", "shop", endpointN(0).Name))
	if r.frame.Load() != nil {
		t.Fatal("a resource never sent holds a frame")
	}
	parts := r.appendDelta(nil)
	if r.frame.Load() == nil {
		t.Fatal("a sent resource keeps no frame")
	}
	head := &discovery.DeltaDiscoveryResponse{Nonce: "1", TypeUrl: resource.WorkloadType}
	hb, _ := proto.Marshal(head)
	builds := 0
	typed := func() proto.Message {
		builds++
		return &discovery.DeltaDiscoveryResponse{Nonce: "1", TypeUrl: resource.WorkloadType, Resources: []*discovery.Resource{r.Delta()}}
	}
	ours, err := newCodec().Marshal(&preEncoded{build: typed, parts: append([][]byte{hb}, parts...)})
	if err != nil || builds != 0 {
		t.Fatalf("our codec: %v, %d typed builds; want none", err, builds)
	}
	stock, err := encoding.GetCodecV2("proto").Marshal(&preEncoded{build: typed, parts: [][]byte{[]byte("unused")}})
	if err != nil || builds != 1 {
		t.Fatalf("stock codec: %v, %d typed builds; want 1", err, builds)
	}
	var a, b discovery.DeltaDiscoveryResponse
	if err := proto.Unmarshal(ours.Materialize(), &a); err != nil {
		t.Fatal(err)
	}
	if err := proto.Unmarshal(stock.Materialize(), &b); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&a, &b) || len(a.GetResources()) != 1 {
		t.Errorf("our parts decode to %v, the stock codec's typed response to %v", &a, &b)
	}
}
