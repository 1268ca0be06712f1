package workload

import (
	"net/netip"
	"testing"

	"google.golang.org/protobuf/proto"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/registry"
)

func testEndpoint() registry.Endpoint {
	return registry.Endpoint{
		Key:            "sandbox-1",
		Node:           "node-a",
		Namespace:      "shop",
		Name:           "web-7d9f8c6b5-x2x4q",
		UID:            "0ae5c03d",
		IPs:            []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::3")},
		ServiceAccount: "web",
		Labels:         map[string]string{"pod-template-hash": "7d9f8c6b5"},
		Owner:          &registry.Owner{Kind: "ReplicaSet", Name: "web-7d9f8c6b5"},
		Healthy:        true,
		Locality:       registry.Locality{Region: "eu-west-1", Zone: "eu-west-1a"},
	}
}

var testConfig = Config{ClusterID: "Kubernetes", TrustDomain: "cluster.local", Network: "net1"}

func TestBuild(t *testing.T) {
	got, err := Build(testConfig, testEndpoint())
	if err != nil {
		t.Fatal(err)
	}
	want := &workloadpb.Workload{
		Uid:               "Kubernetes//Pod/shop/web-7d9f8c6b5-x2x4q",
		Name:              "web-7d9f8c6b5-x2x4q",
		Namespace:         "shop",
		Addresses:         [][]byte{{10, 1, 2, 3}, netip.MustParseAddr("fd00::3").AsSlice()},
		Network:           "net1",
		TrustDomain:       "cluster.local",
		ServiceAccount:    "web",
		Node:              "node-a",
		CanonicalName:     "web",
		CanonicalRevision: "latest",
		WorkloadType:      workloadpb.WorkloadType_DEPLOYMENT,
		WorkloadName:      "web",
		ClusterId:         "Kubernetes",
		Status:            workloadpb.WorkloadStatus_HEALTHY,
		Locality:          &workloadpb.Locality{Region: "eu-west-1", Zone: "eu-west-1a"},
	}
	if !proto.Equal(got, want) {
		t.Fatalf("Build:\n got %v\nwant %v", got, want)
	}
}

func TestBuildFields(t *testing.T) {
	tests := []struct {
		name     string
		edit     func(*registry.Endpoint)
		wantType workloadpb.WorkloadType
		wantName string
		canon    string
		rev      string
		status   workloadpb.WorkloadStatus
		mode     workloadpb.NetworkMode
		addrs    int
	}{
		{
			name: "replicaset without hash label", edit: func(e *registry.Endpoint) { e.Labels = nil },
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "web", rev: "latest", addrs: 2,
		},
		{
			name: "replicaset hash label mismatch", edit: func(e *registry.Endpoint) { e.Labels = map[string]string{"pod-template-hash": "zzz"} },
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5", canon: "web-7d9f8c6b5", rev: "latest", addrs: 2,
		},
		{
			name: "cronjob", edit: func(e *registry.Endpoint) { e.Owner = &registry.Owner{Kind: "Job", Name: "backup-28861440"} },
			wantType: workloadpb.WorkloadType_CRONJOB, wantName: "backup", canon: "backup", rev: "latest", addrs: 2,
		},
		{
			name: "plain job", edit: func(e *registry.Endpoint) { e.Owner = &registry.Owner{Kind: "Job", Name: "migrate-v2"} },
			wantType: workloadpb.WorkloadType_JOB, wantName: "migrate-v2", canon: "migrate-v2", rev: "latest", addrs: 2,
		},
		{
			name: "statefulset", edit: func(e *registry.Endpoint) { e.Owner = &registry.Owner{Kind: "StatefulSet", Name: "db"} },
			wantType: workloadpb.WorkloadType_POD, wantName: "db", canon: "db", rev: "latest", addrs: 2,
		},
		{
			name: "bare pod", edit: func(e *registry.Endpoint) { e.Owner = nil },
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5-x2x4q", canon: "web-7d9f8c6b5-x2x4q", rev: "latest", addrs: 2,
		},
		{name: "istio labels win", edit: func(e *registry.Endpoint) {
			e.Labels = map[string]string{LabelCanonicalName: "shopfront", LabelAppName: "x", LabelCanonicalRevision: "v3", LabelAppVersion: "v1"}
		}, wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "shopfront", rev: "v3", addrs: 2},
		{name: "app.kubernetes.io labels", edit: func(e *registry.Endpoint) {
			e.Labels = map[string]string{"pod-template-hash": "7d9f8c6b5", LabelAppName: "frontend", LabelAppVersion: "1.2"}
		}, wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "frontend", rev: "1.2", addrs: 2},
		{
			name: "unhealthy", edit: func(e *registry.Endpoint) { e.Healthy = false },
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "web", rev: "latest", status: workloadpb.WorkloadStatus_UNHEALTHY, addrs: 2,
		},
		{
			name: "host network", edit: func(e *registry.Endpoint) { e.HostNetwork = true },
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "web", rev: "latest", mode: workloadpb.NetworkMode_HOST_NETWORK, addrs: 2,
		},
		{name: "mapped and duplicate addresses", edit: func(e *registry.Endpoint) {
			e.IPs = []netip.Addr{netip.MustParseAddr("::ffff:10.1.2.3"), netip.MustParseAddr("10.1.2.3")}
		}, wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "web", rev: "latest", addrs: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ep := testEndpoint()
			tt.edit(&ep)
			w, err := Build(testConfig, ep)
			if err != nil {
				t.Fatal(err)
			}
			if w.GetWorkloadType() != tt.wantType || w.GetWorkloadName() != tt.wantName {
				t.Errorf("workload type/name = %v/%q, want %v/%q", w.GetWorkloadType(), w.GetWorkloadName(), tt.wantType, tt.wantName)
			}
			if w.GetCanonicalName() != tt.canon || w.GetCanonicalRevision() != tt.rev {
				t.Errorf("canonical = %q/%q, want %q/%q", w.GetCanonicalName(), w.GetCanonicalRevision(), tt.canon, tt.rev)
			}
			if w.GetStatus() != tt.status || w.GetNetworkMode() != tt.mode {
				t.Errorf("status/mode = %v/%v, want %v/%v", w.GetStatus(), w.GetNetworkMode(), tt.status, tt.mode)
			}
			if len(w.GetAddresses()) != tt.addrs {
				t.Errorf("addresses = %x, want %d", w.GetAddresses(), tt.addrs)
			}
			for _, a := range w.GetAddresses() {
				if len(a) != 4 && len(a) != 16 {
					t.Errorf("address %x is not raw IP bytes", a)
				}
			}
		})
	}
}

func TestBuildRejects(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		edit func(*registry.Endpoint)
	}{
		{name: "no cluster", cfg: Config{}, edit: func(*registry.Endpoint) {}},
		{name: "no addresses", cfg: testConfig, edit: func(e *registry.Endpoint) { e.IPs = nil }},
		{name: "zero address", cfg: testConfig, edit: func(e *registry.Endpoint) { e.IPs = []netip.Addr{{}} }},
		{name: "no name", cfg: testConfig, edit: func(e *registry.Endpoint) { e.Name = "" }},
		{name: "no namespace", cfg: testConfig, edit: func(e *registry.Endpoint) { e.Namespace = "" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ep := testEndpoint()
			tt.edit(&ep)
			if w, err := Build(tt.cfg, ep); err == nil {
				t.Fatalf("Build accepted %+v: %v", ep, w)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	if err := Validate(&workloadpb.Workload{Uid: "c//Pod/a/b", Hostname: "db.example"}); err != nil {
		t.Errorf("hostname-only workload rejected: %v", err)
	}
	if err := Validate(&workloadpb.Workload{Uid: "c//Pod/a/b", Addresses: [][]byte{{1, 2, 3}}}); err == nil {
		t.Error("3-byte address accepted")
	}
	if err := Validate(&workloadpb.Workload{Uid: "c//Pod/a/b"}); err == nil {
		t.Error("workload without address or hostname accepted")
	}
}

func TestIndexVersionsAndOwnership(t *testing.T) {
	x := NewIndex()
	w, err := Build(testConfig, testEndpoint())
	if err != nil {
		t.Fatal(err)
	}
	if changed, err := x.Upsert("s1", w); err != nil || !changed {
		t.Fatalf("first Upsert = %v, %v; want changed", changed, err)
	}
	r1 := x.Get(w.GetUid())
	if changed, _ := x.Upsert("s1", proto.Clone(w).(*workloadpb.Workload)); changed {
		t.Error("Upsert of identical content reported a change")
	}
	if x.Get(w.GetUid()) != r1 {
		t.Error("identical content replaced the resource")
	}
	w2 := proto.Clone(w).(*workloadpb.Workload)
	w2.Status = workloadpb.WorkloadStatus_UNHEALTHY
	// A new sandbox of the same pod takes the uid over.
	if changed, _ := x.Upsert("s2", w2); !changed {
		t.Error("changed content not reported")
	}
	if x.Get(w.GetUid()).Version == r1.Version {
		t.Error("version did not change with content")
	}
	if x.Remove("s1") {
		t.Error("removing the old sandbox removed the pod's workload")
	}
	if x.Get(w.GetUid()) == nil {
		t.Fatal("workload gone after old sandbox removal")
	}
	if !x.Remove("s2") || x.Len() != 0 {
		t.Errorf("Remove(s2) left %d workloads", x.Len())
	}
}
