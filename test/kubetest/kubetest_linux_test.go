package kubetest_test

import (
	"context"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
)

func TestMain(m *testing.M) { harness.Main(m) }

// TestRestartAPIServer: the API server goes down and comes back on the same
// port, certificates and etcd data (what was written before is read after,
// through the same client); a test that ends with it down gets it back
// from its Cleanup.
func TestRestartAPIServer(t *testing.T) {
	c := kubetest.Start(t)
	ctx := context.Background()
	c.Namespace(t, "before")
	namespaces := c.Client.CoreV1().Namespaces()
	for _, tc := range []struct {
		name    string
		restart bool // StartAPIServer in the test; else its Cleanup does
	}{
		{name: "explicit start", restart: true},
		{name: "cleanup starts it", restart: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c.StopAPIServer(t)
			if _, err := namespaces.Get(ctx, "before", metav1.GetOptions{}); err == nil {
				t.Fatal("the API server answers after StopAPIServer")
			}
			if tc.restart {
				t.Logf("kube-apiserver ready again in %s", c.StartAPIServer(t))
			}
		})
		if _, err := namespaces.Get(ctx, "before", metav1.GetOptions{}); err != nil {
			t.Fatalf("after %q: namespace written before the restart: %v", tc.name, err)
		}
	}
}
