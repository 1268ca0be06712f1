package workloadapi

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	workloadpb "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"

	"aether.io/node/agent/identity"
)

// BenchmarkWorkloadAPIUpdate100 is the cost of one Workload API update on
// a node with 100 accounts, from Store.SyncReport to the message received
// by a client stream (in-memory gRPC connection): one_account is one pod
// of a new service account added or removed (one mint or drop, the
// response rebuilt around 100 cached entries); rotation_wave is all 100
// SVIDs rotating at once (100 mints and encodings). Reports p50-ns and
// p99-ns.
func BenchmarkWorkloadAPIUpdate100(b *testing.B) {
	cases := []struct {
		name string
		// step changes the store once and returns the SVID count expected.
		step func(i int, st *identity.Store, clk *clock, base []identity.Account) int
	}{
		{"one_account", func(i int, st *identity.Store, _ *clock, base []identity.Account) int {
			want := base
			if i%2 == 0 {
				want = append(slices.Clip(base), identity.Account{Namespace: "ns", ServiceAccount: "extra"})
			}
			if _, err := st.SyncReport(want); err != nil {
				b.Fatal(err)
			}
			return len(want)
		}},
		{"rotation_wave", func(_ int, st *identity.Store, clk *clock, base []identity.Account) int {
			clk.now = clk.now.Add(3 * time.Hour) // past the half-life of every SVID
			if r, err := st.SyncReport(base); err != nil || r.Rotated != len(base) {
				b.Fatalf("rotation wave: %+v, %v", r, err)
			}
			return len(base)
		}},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			st, clk := newStore(b, 4*time.Hour)
			base := make([]identity.Account, 100)
			for i := range base {
				base[i] = identity.Account{Namespace: "ns", ServiceAccount: fmt.Sprintf("sa-%03d", i)}
			}
			if err := st.Sync(base); err != nil {
				b.Fatal(err)
			}
			c := serve(b, New(st, nil))
			// No deadline: a rotation wave costs tens of milliseconds a time.
			ctx, cancel := context.WithCancel(context.Background())
			b.Cleanup(cancel)
			s, err := c.FetchX509SVID(withHeader(ctx), &workloadpb.X509SVIDRequest{})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.Recv(); err != nil {
				b.Fatal(err)
			}
			var lat []time.Duration
			i := 0
			for b.Loop() {
				start := time.Now()
				want := tc.step(i, st, clk, base)
				resp, err := s.Recv()
				if err != nil || len(resp.GetSvids()) != want {
					b.Fatalf("update %d: %d SVIDs, %v; want %d", i, len(resp.GetSvids()), err, want)
				}
				lat = append(lat, time.Since(start))
				i++
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}
