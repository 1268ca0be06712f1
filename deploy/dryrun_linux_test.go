package deploy_test

import (
	"context"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"aether.io/node/deploy/chart"
	"aether.io/node/test/kubetest"
)

// TestServerSideDryRun creates every object of every value set's render
// with DryRun=All against a real kube-apiserver (test/kubetest): the API
// server's validation and admission must accept all of them. The release
// namespace is created first, as `helm install --create-namespace` or an
// operator does; the chart never creates it.
func TestServerSideDryRun(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	cl.Namespace(t, chart.Namespace)
	dc, err := discovery.NewDiscoveryClientForConfig(cl.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cl.Config)
	if err != nil {
		t.Fatal(err)
	}
	forEachSet(t, func(t *testing.T, r *render) {
		for _, obj := range r.objs {
			u := &unstructured.Unstructured{}
			if u.Object, err = runtime.DefaultUnstructuredConverter.ToUnstructured(obj); err != nil {
				t.Fatal(err)
			}
			gvk := obj.GetObjectKind().GroupVersionKind()
			u.SetGroupVersionKind(gvk)
			m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Fatalf("the API server does not serve %s: %v", gvk, err)
			}
			var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
			if m.Scope.Name() == meta.RESTScopeNameNamespace {
				if u.GetNamespace() != chart.Namespace {
					t.Errorf("%s %s is namespaced but has namespace %q, want the release namespace %s", gvk.Kind, u.GetName(), u.GetNamespace(), chart.Namespace)
				}
				ri = dyn.Resource(m.Resource).Namespace(u.GetNamespace())
			} else if u.GetNamespace() != "" {
				t.Errorf("cluster-scoped %s %s has namespace %q", gvk.Kind, u.GetName(), u.GetNamespace())
			}
			if _, err := ri.Create(context.Background(), u, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: metav1.FieldValidationStrict}); err != nil {
				t.Errorf("the API server rejects %s %s: %v", gvk.Kind, u.GetName(), err)
				continue
			}
			t.Logf("accepted %s %s (dry run)", gvk.Kind, u.GetName())
		}
	})
}
