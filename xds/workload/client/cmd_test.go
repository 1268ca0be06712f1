package client_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	securitypb "aether.io/node/api/istio/security"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/registry"
	"aether.io/node/xds/workload"
	"aether.io/node/xds/workload/client"
)

func serve(t *testing.T) (*workload.Index, string) {
	t.Helper()
	x := workload.NewIndex()
	srv, err := workload.NewServer(x, workload.ServerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(t.TempDir(), "run", "xds.sock")
	lis, err := unixsock.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	return x, socket
}

func put(t *testing.T, x *workload.Index, key, name string, healthy bool, ips ...string) {
	t.Helper()
	ep := registry.Endpoint{
		Key: key, Node: "node-a", Namespace: "shop", Name: name, Healthy: healthy,
		Owner: &registry.Owner{Kind: "Job", Name: "backup-28861440"},
	}
	for _, ip := range ips {
		ep.IPs = append(ep.IPs, netip.MustParseAddr(ip))
	}
	w, err := workload.Build(workload.Config{ClusterID: "c1"}, ep)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Upsert(key, w); err != nil {
		t.Fatal(err)
	}
}

func TestRunTable(t *testing.T) {
	x, socket := serve(t)
	put(t, x, "k1", "backup-1", true, "10.0.0.1", "fd00::1")
	put(t, x, "k2", "backup-2", false, "10.0.0.2")
	var out bytes.Buffer
	if err := client.Run(context.Background(), []string{"--xds-socket", socket}, &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("table has %d lines, want header + 2:\n%s", len(lines), out.String())
	}
	for _, want := range [][]string{
		{"UID", "NAME", "NAMESPACE", "ADDRESSES", "NODE", "STATUS", "TYPE", "WORKLOAD", "SERVICES"},
		{"c1//Pod/shop/backup-1", "backup-1", "shop", "10.0.0.1,fd00::1", "node-a", "HEALTHY", "CRONJOB", "backup", "-"},
		{"c1//Pod/shop/backup-2", "backup-2", "shop", "10.0.0.2", "node-a", "UNHEALTHY", "CRONJOB", "backup", "-"},
	} {
		got := strings.Fields(lines[0])
		lines = lines[1:]
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("row %q, want %q", got, want)
		}
	}
}

func TestRunJSONNamed(t *testing.T) {
	x, socket := serve(t)
	put(t, x, "k1", "backup-1", true, "10.0.0.1")
	put(t, x, "k2", "backup-2", true, "10.0.0.2")
	var out bytes.Buffer
	if err := client.Run(context.Background(), []string{"--xds-socket", socket, "-o", "json", "c1//Pod/shop/backup-2"}, &out); err != nil {
		t.Fatal(err)
	}
	var rows []client.Row
	if err := json.Unmarshal(out.Bytes(), &rows); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out.String())
	}
	if len(rows) != 1 || rows[0].UID != "c1//Pod/shop/backup-2" || rows[0].Addresses[0] != "10.0.0.2" {
		t.Fatalf("rows = %+v", rows)
	}
}

// syncBuffer is a bytes.Buffer safe to read while Run writes.
type syncBuffer struct {
	ch chan string
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.ch <- string(p)
	return len(p), nil
}

func TestRunWatch(t *testing.T) {
	x, socket := serve(t)
	put(t, x, "k1", "backup-1", true, "10.0.0.1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &syncBuffer{ch: make(chan string, 64)}
	done := make(chan error, 1)
	go func() { done <- client.Run(ctx, []string{"--xds-socket", socket, "--watch", "-o", "json"}, out) }()
	next := func() map[string]any {
		t.Helper()
		select {
		case s := <-out.ch:
			var m map[string]any
			if err := json.Unmarshal([]byte(s), &m); err != nil {
				t.Fatalf("line %q: %v", s, err)
			}
			return m
		case <-time.After(60 * time.Second):
			t.Fatal("no output within 60s")
			return nil
		}
	}
	if ev := next(); ev["event"] != "put" || ev["uid"] != "c1//Pod/shop/backup-1" {
		t.Fatalf("initial event %v", ev)
	}
	put(t, x, "k2", "backup-2", true, "10.0.0.2")
	if ev := next(); ev["event"] != "put" || ev["uid"] != "c1//Pod/shop/backup-2" {
		t.Fatalf("put event %v", ev)
	}
	x.Remove("k1")
	if ev := next(); ev["event"] != "removed" || ev["uid"] != "c1//Pod/shop/backup-1" {
		t.Fatalf("removed event %v", ev)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run after cancel: %v", err)
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	var out bytes.Buffer
	if err := client.Run(context.Background(), []string{"-o", "yaml"}, &out); err == nil {
		t.Error("-o yaml accepted")
	}
	if err := client.Run(context.Background(), []string{"--xds-socket", filepath.Join(t.TempDir(), "none.sock")}, &out); err == nil {
		t.Error("missing server accepted")
	}
}

// TestRunServices: aetherctl services lists each Service with its VIP and
// ports and, under it, its endpoints (node, serving, mesh or not); a
// Service without endpoints says so; aetherctl workloads shows the
// membership.
func TestRunServices(t *testing.T) {
	x, socket := serve(t)
	web := "shop/web.shop.svc.cluster.local"
	x.SetMembership(membership{"c1//Pod/shop/backup-1": {web: {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}}})
	put(t, x, "k1", "backup-1", true, "10.0.0.1")
	put(t, x, "k2", "backup-2", true, "10.0.0.2")
	svcs := x.Addresses().Writer(workload.ServiceSource)
	for _, s := range []*workloadpb.Service{
		{Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Addresses: []*workloadpb.NetworkAddress{{Address: []byte{10, 96, 0, 10}}}, Ports: []*workloadpb.Port{{ServicePort: 80}}},
		{Name: "db", Namespace: "shop", Hostname: "db.shop.svc.cluster.local", Ports: []*workloadpb.Port{{ServicePort: 5432, TargetPort: 5432}}},
	} {
		if _, err := svcs.UpsertService(s); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	if err := client.RunServices(context.Background(), []string{"--xds-socket", socket}, &out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"shop/db.shop.svc.cluster.local  None (headless)  5432->5432  (none)",
		"shop/web.shop.svc.cluster.local  10.96.0.10",
		"80->8080  shop/backup-1  10.0.0.1   node-a  yes  no",
	} {
		if !strings.Contains(strings.Join(strings.Fields(got), " "), strings.Join(strings.Fields(want), " ")) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "backup-2") {
		t.Errorf("a workload outside the Service is listed:\n%s", got)
	}
	out.Reset()
	if err := client.Run(context.Background(), []string{"--xds-socket", socket, "-o", "json", "c1//Pod/shop/backup-1"}, &out); err != nil {
		t.Fatal(err)
	}
	var rows []client.Row
	if err := json.Unmarshal(out.Bytes(), &rows); err != nil || len(rows) != 1 || len(rows[0].Services) != 1 || rows[0].Services[0] != web {
		t.Fatalf("workloads -o json = %s (%v): want backup-1 naming %s", out.String(), err, web)
	}
}

type membership map[string]map[string]*workloadpb.PortList

func (m membership) Services(uid string) map[string]*workloadpb.PortList { return m[uid] }

// TestRunPolicyCheck: aetherctl policy check decides as the destination's
// proxy would from what workload discovery serves, and names the policy;
// aetherctl policies lists each workload's policies.
func TestRunPolicyCheck(t *testing.T) {
	x, socket := serve(t)
	for i, name := range []string{"client", "server"} {
		w, err := workload.Build(workload.Config{ClusterID: "c1", TrustDomain: "cluster.local"}, registry.Endpoint{
			Key: name, Node: "node-a", Namespace: "shop", Name: name, ServiceAccount: name, Healthy: true, FixedName: true,
			IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})},
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Upsert(name, w); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := x.Authorizations().Writer(workload.AuthorizationSource).UpsertAuthorization(&securitypb.Authorization{
		Name: "only-8080", Namespace: "shop", Scope: securitypb.Scope_NAMESPACE, Action: securitypb.Action_ALLOW,
		Groups: []*securitypb.Group{{Rules: []*securitypb.Rules{{Matches: []*securitypb.Match{{DestinationPorts: []uint32{8080}}}}}}},
	}); err != nil {
		t.Fatal(err)
	}
	for arg, want := range map[string]string{
		"shop/server:8080": "ALLOW: shop/client -> shop/server (allowed_by_policy)",
		"shop/server:9090": "DENY: shop/client -> shop/server (no_allow_match)",
	} {
		var out bytes.Buffer
		if err := client.RunPolicyCheck(context.Background(), []string{"--xds-socket", socket, "shop/client", arg}, &out); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(out.String(), want) || (strings.HasPrefix(want, "ALLOW") && !strings.Contains(out.String(), "decided by: shop/only-8080")) {
			t.Errorf("policy check %s:\n%s\nwant %q", arg, out.String(), want)
		}
		if !strings.Contains(out.String(), "spiffe://cluster.local/ns/shop/sa/client") {
			t.Errorf("the source identity is not named:\n%s", out.String())
		}
	}
	if err := client.RunPolicyCheck(context.Background(), []string{"--xds-socket", socket, "shop/client", "shop/nobody:80"}, &bytes.Buffer{}); err == nil {
		t.Error("an unknown destination was accepted")
	}
	var out bytes.Buffer
	if err := client.RunPolicies(context.Background(), []string{"--xds-socket", socket}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(strings.Fields(out.String()), " "), "shop/server node-a shop/only-8080") {
		t.Errorf("aetherctl policies:\n%s", out.String())
	}
}
