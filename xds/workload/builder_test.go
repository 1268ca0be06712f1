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
			// istiod names a ReplicaSet's pod without pod-template-hash after
			// the pod (see TestWorkloadTypeAndNameAsIstiod).
			name: "replicaset without hash label", edit: func(e *registry.Endpoint) { e.Labels = nil },
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5-x2x4q", canon: "web-7d9f8c6b5-x2x4q", rev: "latest", addrs: 2,
		},
		{
			name: "replicaset hash label mismatch", edit: func(e *registry.Endpoint) { e.Labels = map[string]string{"pod-template-hash": "zzz"} },
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5-x2x4q", canon: "web-7d9f8c6b5-x2x4q", rev: "latest", addrs: 2,
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
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5-x2x4q", canon: "web-7d9f8c6b5-x2x4q", rev: "latest", addrs: 2,
		},
		{
			name: "bare pod", edit: func(e *registry.Endpoint) { e.Owner = nil },
			wantType: workloadpb.WorkloadType_POD, wantName: "web-7d9f8c6b5-x2x4q", canon: "web-7d9f8c6b5-x2x4q", rev: "latest", addrs: 2,
		},
		{name: "empty app label is present", edit: func(e *registry.Endpoint) {
			e.Labels = map[string]string{"pod-template-hash": "7d9f8c6b5", "app": "", "version": ""}
		}, wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web", canon: "", rev: "", addrs: 2},
		{name: "istio labels win", edit: func(e *registry.Endpoint) {
			e.Labels = map[string]string{"pod-template-hash": "7d9f8c6b5", LabelCanonicalName: "shopfront", LabelAppName: "x", LabelCanonicalRevision: "v3", LabelAppVersion: "v1"}
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

// TestBuildTunnelProtocol: with Config.HBONE a managed pod is marked HBONE,
// a host-network pod (no netns of its own, no :15008) is not; without it
// nothing is.
func TestBuildTunnelProtocol(t *testing.T) {
	hbone := testConfig
	hbone.HBONE = true
	tests := []struct {
		name        string
		cfg         Config
		hostNetwork bool
		want        workloadpb.TunnelProtocol
	}{
		{"hbone off", testConfig, false, workloadpb.TunnelProtocol_NONE},
		{"hbone on", hbone, false, workloadpb.TunnelProtocol_HBONE},
		{"hbone on, host network", hbone, true, workloadpb.TunnelProtocol_NONE},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ep := testEndpoint()
			ep.HostNetwork = tt.hostNetwork
			w, err := Build(tt.cfg, ep)
			if err != nil {
				t.Fatal(err)
			}
			if got := w.GetTunnelProtocol(); got != tt.want {
				t.Errorf("tunnel_protocol = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestWorkloadTypeAndNameAsIstiod: the workload type and name of a pod
// are what istiod sends for it. Each case follows istio.io/istio
// pilot/pkg/serviceregistry/kube/controller/ambient/workloads.go
// workloadNameAndType, which maps pkg/kube/util.go GetDeployMetaFromPod's
// kind (Deployment, Job, CronJob; anything else is POD named after the pod).
func TestWorkloadTypeAndNameAsIstiod(t *testing.T) {
	hash := map[string]string{"pod-template-hash": "7d9f8c6b5"}
	for _, tc := range []struct {
		name      string
		pod       string
		fixedName bool
		owner     *registry.Owner
		labels    map[string]string
		wantType  workloadpb.WorkloadType
		wantName  string
	}{
		// GetDeployMetaFromPod: no generateName → Kind Pod, the pod's name,
		// whatever the owner references say.
		{name: "bare pod", pod: "debug", wantType: workloadpb.WorkloadType_POD, wantName: "debug"},
		{
			name: "name not generated, owned by a ReplicaSet", pod: "web-manual", fixedName: true,
			owner: &registry.Owner{Kind: "ReplicaSet", Name: "web-7d9f8c6b5"}, labels: hash,
			wantType: workloadpb.WorkloadType_POD, wantName: "web-manual",
		},
		// generateName but no controller reference: the pod.
		{name: "generated name, no controller", pod: "web-x2x4q", wantType: workloadpb.WorkloadType_POD, wantName: "web-x2x4q"},
		// ReplicaSet + pod-template-hash suffix → Kind Deployment, the name
		// without "-<hash>".
		{
			name: "deployment", pod: "web-7d9f8c6b5-x2x4q", owner: &registry.Owner{Kind: "ReplicaSet", Name: "web-7d9f8c6b5"}, labels: hash,
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web",
		},
		// The suffix test is on the hash alone, the trim on "-<hash>": a
		// ReplicaSet name ending in the hash without the dash keeps its name.
		{
			name: "replicaset name ends with the hash without a dash", pod: "web7d9f8c6b5-x2x4q",
			owner: &registry.Owner{Kind: "ReplicaSet", Name: "web7d9f8c6b5"}, labels: hash,
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web7d9f8c6b5",
		},
		// ReplicaSet without pod-template-hash (a bare ReplicaSet) → Kind
		// ReplicaSet → workloadNameAndType's default: POD, the pod's name.
		{
			name: "replicaset without pod-template-hash", pod: "cache-8kx2z", owner: &registry.Owner{Kind: "ReplicaSet", Name: "cache"},
			wantType: workloadpb.WorkloadType_POD, wantName: "cache-8kx2z",
		},
		{
			name: "replicaset whose name lacks the hash", pod: "cache-8kx2z", owner: &registry.Owner{Kind: "ReplicaSet", Name: "cache"}, labels: hash,
			wantType: workloadpb.WorkloadType_POD, wantName: "cache-8kx2z",
		},
		// Argo Rollouts' hash label gives Kind Rollout, which the ambient
		// builder does not map: POD.
		{
			name: "argo rollout", pod: "web-6c5d-abcde", owner: &registry.Owner{Kind: "ReplicaSet", Name: "web-6c5d"},
			labels:   map[string]string{"rollouts-pod-template-hash": "6c5d"},
			wantType: workloadpb.WorkloadType_POD, wantName: "web-6c5d-abcde",
		},
		// StatefulSet, DaemonSet, ReplicationController: kinds kept by
		// GetDeployMetaFromPod, default of workloadNameAndType: POD, the pod.
		{
			name: "statefulset", pod: "db-0", owner: &registry.Owner{Kind: "StatefulSet", Name: "db"},
			wantType: workloadpb.WorkloadType_POD, wantName: "db-0",
		},
		{
			name: "daemonset", pod: "agent-q7w2x", owner: &registry.Owner{Kind: "DaemonSet", Name: "agent"},
			wantType: workloadpb.WorkloadType_POD, wantName: "agent-q7w2x",
		},
		{
			name: "openshift deploymentconfig", pod: "app-1-abcde", owner: &registry.Owner{Kind: "ReplicationController", Name: "app-1"},
			labels:   map[string]string{"deploymentconfig": "app"},
			wantType: workloadpb.WorkloadType_POD, wantName: "app-1-abcde",
		},
		// Job named "<cronjob>-<8 to 10 digits>" (cronJobNameRegexp
		// `(.+)-\d{8,10}$`) → Kind CronJob.
		{
			name: "job of a cronjob", pod: "backup-28861440-abcde", owner: &registry.Owner{Kind: "Job", Name: "backup-28861440"},
			wantType: workloadpb.WorkloadType_CRONJOB, wantName: "backup",
		},
		{
			name: "job of a cronjob, 10 digits", pod: "nightly-db-2886144000-abcde", owner: &registry.Owner{Kind: "Job", Name: "nightly-db-2886144000"},
			wantType: workloadpb.WorkloadType_CRONJOB, wantName: "nightly-db",
		},
		{
			name: "job with 11 digits is a plain job", pod: "x-28861440000-abcde", owner: &registry.Owner{Kind: "Job", Name: "x-28861440000"},
			wantType: workloadpb.WorkloadType_JOB, wantName: "x-28861440000",
		},
		{
			name: "job with 7 digits is a plain job", pod: "x-2886144-abcde", owner: &registry.Owner{Kind: "Job", Name: "x-2886144"},
			wantType: workloadpb.WorkloadType_JOB, wantName: "x-2886144",
		},
		{
			name: "digits alone are a plain job", pod: "-28861440-abcde", owner: &registry.Owner{Kind: "Job", Name: "-28861440"},
			wantType: workloadpb.WorkloadType_JOB, wantName: "-28861440",
		},
		{
			name: "plain job", pod: "migrate-v2-abcde", owner: &registry.Owner{Kind: "Job", Name: "migrate-v2"},
			wantType: workloadpb.WorkloadType_JOB, wantName: "migrate-v2",
		},
		// A Deployment or CronJob as the direct controller keeps its kind.
		{
			name: "deployment as direct controller", pod: "web-abcde", owner: &registry.Owner{Kind: "Deployment", Name: "web"},
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web",
		},
		{
			name: "cronjob as direct controller", pod: "tick-abcde", owner: &registry.Owner{Kind: "CronJob", Name: "tick"},
			wantType: workloadpb.WorkloadType_CRONJOB, wantName: "tick",
		},
		// A derived name that is empty falls back to the pod's name; the
		// kind stays.
		{
			name: "job owner without a name", pod: "orphan-abcde", owner: &registry.Owner{Kind: "Job"},
			wantType: workloadpb.WorkloadType_JOB, wantName: "orphan-abcde",
		},
		// The ambient builder applies no workload-name label override.
		{
			name: "workload-name label ignored", pod: "web-7d9f8c6b5-x2x4q", owner: &registry.Owner{Kind: "ReplicaSet", Name: "web-7d9f8c6b5"},
			labels:   map[string]string{"pod-template-hash": "7d9f8c6b5", "service.istio.io/workload-name": "other"},
			wantType: workloadpb.WorkloadType_DEPLOYMENT, wantName: "web",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep := testEndpoint()
			ep.Name, ep.FixedName, ep.Owner, ep.Labels = tc.pod, tc.fixedName, tc.owner, tc.labels
			w, err := Build(testConfig, ep)
			if err != nil {
				t.Fatal(err)
			}
			if w.GetWorkloadType() != tc.wantType || w.GetWorkloadName() != tc.wantName {
				t.Errorf("workload type/name = %v/%q, want %v/%q", w.GetWorkloadType(), w.GetWorkloadName(), tc.wantType, tc.wantName)
			}
			// CanonicalService falls back to the workload name.
			if w.GetCanonicalName() != tc.wantName {
				t.Errorf("canonical name = %q, want the workload name %q", w.GetCanonicalName(), tc.wantName)
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
