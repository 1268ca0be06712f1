package dataplane

import (
	"log/slog"
	"strings"
	"testing"

	"aether.io/node/proxy/hbone/hbonetest"
)

func TestFitFDLimit(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	base := Config{}.withDefaults() // 65536 conns, 16384 flows: 410624 fds
	tests := []struct {
		name                           string
		limit                          uint64
		conns, perPod, flows, flowsPod int
		wantErr                        string
	}{
		{name: "enough", limit: 1 << 20, conns: 65536, perPod: 8192, flows: 16384, flowsPod: 1024},
		{name: "exactly enough", limit: 65536*6 + 16384 + 1024, conns: 65536, perPod: 8192, flows: 16384, flowsPod: 1024},
		// Budget 64512: flows get a quarter (16128), connections the rest / 6.
		{name: "a container's 65536", limit: 65536, conns: 8064, perPod: 8064, flows: 16128, flowsPod: 1024},
		// Budget 18976: 4744 flows, 2372 connections.
		{name: "this machine's 20000", limit: 20000, conns: 2372, perPod: 2372, flows: 4744, flowsPod: 1024},
		{name: "too small", limit: 1024, wantErr: "open file limit 1024 is too small for the proxy"},
	}
	// A small UDP cap is kept; connections take the rest.
	small := base
	small.MaxUDPFlows, small.FDLimit = 6, 20000
	if got, err := fitFDLimit(small, log); err != nil || got.MaxUDPFlows != 6 || got.MaxConns != (20000-1024-6)/6 {
		t.Fatalf("small UDP cap: flows %d, conns %d, %v; want 6, %d", got.MaxUDPFlows, got.MaxConns, err, (20000-1024-6)/6)
	}
	// With HBONE on, the inbound HBONE connections count too (1024 by
	// default, one descriptor each, within a quarter of the budget).
	hb := base
	hb.Certs, hb.FDLimit = hbonetest.NewCerts(nil), 20000
	if got, err := fitFDLimit(hb, log); err != nil || got.HBONEMaxConns != 1024 || got.MaxConns != (18976-4744-1024)/6 {
		t.Fatalf("with HBONE: hbone conns %d, conns %d, %v; want 1024, %d", got.HBONEMaxConns, got.MaxConns, err, (18976-4744-1024)/6)
	}
	hb.FDLimit = 4096 // budget 3072: flows 768, HBONE 768, connections the rest
	if got, err := fitFDLimit(hb, log); err != nil || got.HBONEMaxConns != 768 || got.HBONEMaxConnsPerSource != 64 || got.MaxConns != (3072-768-768)/6 {
		t.Fatalf("with HBONE at 4096: hbone conns %d/%d per source, conns %d, %v; want 768/64, %d", got.HBONEMaxConns, got.HBONEMaxConnsPerSource, got.MaxConns, err, (3072-768-768)/6)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := base
			c.FDLimit = tt.limit
			got, err := fitFDLimit(c, log)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.MaxConns != tt.conns || got.MaxConnsPerPod != tt.perPod || got.MaxUDPFlows != tt.flows || got.MaxUDPFlowsPerPod != tt.flowsPod {
				t.Fatalf("caps = conns %d/%d per pod, flows %d/%d per pod; want %d/%d, %d/%d",
					got.MaxConns, got.MaxConnsPerPod, got.MaxUDPFlows, got.MaxUDPFlowsPerPod, tt.conns, tt.perPod, tt.flows, tt.flowsPod)
			}
			if need := uint64(got.MaxConns)*fdsPerConn + uint64(got.MaxUDPFlows)*fdsPerFlow + fdReserve; need > tt.limit {
				t.Fatalf("lowered caps still need %d descriptors, limit %d", need, tt.limit)
			}
		})
	}
}
