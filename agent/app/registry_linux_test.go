package app

import (
	"context"
	"log/slog"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"aether.io/node/registry/etcd/etcdtest"
)

// TestEtcdRejectedIsExported: values the etcd backend ignores (a key
// outside <prefix><node>/<key>, a value naming another node) are counted
// in aether_registry_etcd_rejected_total on the agent's metrics.
func TestEtcdRejectedIsExported(t *testing.T) {
	e := etcdtest.Start(t)
	ctx := context.Background()
	c := testConfig(t, "--registry", "etcd", "--etcd-endpoints", e.Endpoint(), "--etcd-insecure", "--etcd-prefix", "/test/eps/")
	metrics := prometheus.NewRegistry()
	reg, closeReg, err := newRegistry(c, nil, slog.New(slog.DiscardHandler), metrics)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeReg)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	for k, v := range map[string]string{
		"/test/eps/outside-the-layout": `{"key":"x"}`,
		"/test/eps/n2/sb-1":            `{"key":"sb-1","node":"n1"}`,
	} {
		if _, err := cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := reg.List(ctx); err != nil {
		t.Fatal(err)
	}
	mfs, err := metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != 1 || mfs[0].GetName() != "aether_registry_etcd_rejected_total" || len(mfs[0].GetMetric()) != 1 {
		t.Fatalf("metrics = %v, want aether_registry_etcd_rejected_total alone", mfs)
	}
	if got := mfs[0].GetMetric()[0].GetCounter().GetValue(); got != 2 {
		t.Errorf("aether_registry_etcd_rejected_total = %v, want 2", got)
	}
}
