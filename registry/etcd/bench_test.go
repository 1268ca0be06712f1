package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"aether.io/node/registry/etcd/etcdtest"
)

// BenchmarkLivenessRead compares what a liveness tick reads: every node's
// endpoints (List, what it read before) against this node's (ListNode), on
// a cluster of 100 nodes with 30 endpoints each.
func BenchmarkLivenessRead(b *testing.B) {
	const nodes, perNode = 100, 30
	e := etcdtest.Start(b)
	r, err := New(Options{Endpoints: []string{e.Endpoint()}, Node: "node-0", Prefix: "/bench/eps/", Insecure: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	ctx := context.Background()
	for n := range nodes {
		node := fmt.Sprintf("node-%d", n)
		for i := range perNode {
			v, err := json.Marshal(ep(node, i))
			if err != nil {
				b.Fatal(err)
			}
			if _, err := r.cli.Put(ctx, r.prefix+node+"/"+ep(node, i).Key, string(v)); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, bc := range []struct {
		name string
		read func(context.Context) (int, error)
	}{
		{"List", func(ctx context.Context) (int, error) { eps, err := r.List(ctx); return len(eps), err }},
		{"ListNode", func(ctx context.Context) (int, error) { eps, err := r.ListNode(ctx); return len(eps), err }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var n int
			for b.Loop() {
				if n, err = bc.read(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(n), "endpoints/op")
		})
	}
}
