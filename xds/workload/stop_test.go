package workload

import (
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestStopEndsStreams: Stop ends an open stream with Unavailable (so a
// graceful gRPC stop does not wait for the client to leave), and a stream
// opened after Stop ends the same way.
func TestStopEndsStreams(t *testing.T) {
	x := NewIndex()
	fill(t, x, 3)
	ts := startServer(t, x)
	d := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{})
	if n := len(d.recv().GetResources()); n != 3 {
		t.Fatalf("initial push had %d workloads, want 3", n)
	}
	ts.srv.Stop()
	ts.srv.Stop() // idempotent
	if _, err := d.s.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("open stream after Stop: %v; want Unavailable", err)
	}
	late := openDelta(t, ts.socket, &discovery.DeltaDiscoveryRequest{})
	if _, err := late.s.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("stream opened after Stop: %v; want Unavailable", err)
	}
}
