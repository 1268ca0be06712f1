package adsclient_test

import (
	"fmt"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"

	"aether.io/node/xds/adsclient"
)

// TestCodecRoundTrip: what Codec marshals decodes, with the standard proto
// codec, to the request it was given, every field included.
func TestCodecRoundTrip(t *testing.T) {
	many := map[string]string{}
	for i := range 5000 {
		many[fmt.Sprintf("Kubernetes//Pod/shop/web-%05d", i)] = fmt.Sprintf("%016x", i*7919)
	}
	tests := []struct {
		name string
		req  *discovery.DeltaDiscoveryRequest
	}{
		{name: "ack", req: &discovery.DeltaDiscoveryRequest{TypeUrl: "t", ResponseNonce: "7"}},
		{name: "nack", req: &discovery.DeltaDiscoveryRequest{TypeUrl: "t", ResponseNonce: "8", ErrorDetail: &status.Status{Code: 3, Message: "bad"}}},
		{name: "versions", req: &discovery.DeltaDiscoveryRequest{
			Node: &core.Node{Id: "n1", Cluster: "c"}, TypeUrl: "t", ResourceNamesSubscribe: []string{"*", "a"},
			ResourceNamesUnsubscribe: []string{"b"}, ResourceLocatorsSubscribe: []*discovery.ResourceLocator{{Name: "l"}},
			InitialResourceVersions: map[string]string{"a": "1", "": "empty-name", "no-version": ""},
		}},
		{name: "many versions", req: &discovery.DeltaDiscoveryRequest{TypeUrl: "t", ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: many}},
	}
	c := adsclient.Codec()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data, err := c.Marshal(tt.req)
			if err != nil {
				t.Fatal(err)
			}
			got := &discovery.DeltaDiscoveryRequest{}
			if err := proto.Unmarshal(data.Materialize(), got); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tt.req) {
				t.Fatalf("decoded %v, want %v", got, tt.req)
			}
			if want := proto.Size(tt.req); data.Len() != want {
				t.Fatalf("encoded %d bytes, the proto codec %d", data.Len(), want)
			}
		})
	}
}

// BenchmarkMarshalVersions is a reconnect's first request with 70k
// initial_resource_versions: Codec ("ours") against the standard proto
// codec ("stock").
func BenchmarkMarshalVersions(b *testing.B) {
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: "t", ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: map[string]string{}}
	for i := range 70000 {
		req.InitialResourceVersions[fmt.Sprintf("Kubernetes//Pod/shop/web-7d9f8c6b5-%05d", i)] = fmt.Sprintf("%016x", i*7919)
	}
	for _, kind := range []string{"ours", "stock"} {
		b.Run(kind, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				var err error
				if kind == "ours" {
					_, err = adsclient.Codec().Marshal(req)
				} else {
					_, err = proto.Marshal(req)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
