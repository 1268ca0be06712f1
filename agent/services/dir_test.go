package services

import (
	"os"
	"path/filepath"
	"testing"

	"aether.io/node/agent/podsource/manifests"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/workload"
)

const dirManifests = `apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: http}
---
apiVersion: v1
kind: Pod
metadata: {name: web-a, namespace: shop, labels: {app: web}}
spec:
  containers:
  - {name: app, image: app, ports: [{name: http, containerPort: 8080}]}
status:
  podIPs: [{ip: 10.0.0.1}]
---
apiVersion: v1
kind: Pod
metadata: {name: web-b, namespace: shop, labels: {app: web}}
spec:
  containers:
  - {name: app, image: app, ports: [{name: http, containerPort: 8081}]}
status:
  podIPs: [{ip: 10.0.0.2}]
  conditions: [{type: Ready, status: "False"}]
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: shop, labels: {app: other}}
spec:
  containers: [{name: app, image: app}]
`

// TestDirDerivesSlices: a directory's Service with a selector gets its
// endpoints from the directory's pods, as the EndpointSlice controller
// would make them: the named target port resolved per pod, a not-ready
// pod left out, a pod the selector does not match left out; removing the
// file withdraws the Service.
func TestDirDerivesSlices(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "web.yaml")
	if err := os.WriteFile(path, []byte(dirManifests), 0o644); err != nil {
		t.Fatal(err)
	}
	x := workload.NewIndex()
	m := New(testCfg, x, Metrics{}, nil)
	d := manifests.NewDir(dir, 0, nil, m)
	d.Scan()
	if served(t, x, webHost).GetService() == nil {
		t.Fatal("service not served")
	}
	a := served(t, x, uid("web-a")).GetWorkload()
	if got := ports(t, a); len(got) != 1 || got[80] != 8080 {
		t.Errorf("web-a ports %v, want 80 -> 8080", got)
	}
	if a.GetTunnelProtocol() != workloadpb.TunnelProtocol_NONE {
		t.Errorf("web-a without a record: tunnel %v", a.GetTunnelProtocol())
	}
	if served(t, x, uid("web-b")) != nil || served(t, x, uid("other")) != nil {
		t.Error("a not-ready or unselected pod is an endpoint")
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	d.Scan()
	if x.Addresses().Len() != 0 {
		t.Errorf("after the file went: %d addresses", x.Addresses().Len())
	}
}
