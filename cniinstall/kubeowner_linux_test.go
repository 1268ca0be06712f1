package cniinstall

import (
	"context"
	"crypto/tls"
	"net/http"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"aether.io/node/test/kubetest"
)

// TestKubeOwnerAPIServer asks a real kube-apiserver, with a token that has
// only the RBAC rules the chart must give the installer (get its pod, get
// its DaemonSet): a DaemonSet that stays, one being deleted, one gone, a
// token without the rules, and an API server that is down.
func TestKubeOwnerAPIServer(t *testing.T) {
	cl := kubetest.Start(t)
	const ns, dsName, podName, holdFinalizer = "aether-system", "aether-node", "aether-node-x2x4q", "aether.io/test-hold"
	cl.Namespace(t, ns)
	ctx := context.Background()
	labels := map[string]string{"app": dsName}
	ds, err := cl.Client.AppsV1().DaemonSets(ns).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: dsName, Finalizers: []string{holdFinalizer}},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "install", Image: "aether-node:test"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The pod as the DaemonSet controller makes it (there is no
	// controller-manager here).
	for _, p := range []*corev1.Pod{
		{ObjectMeta: metav1.ObjectMeta{
			Name: podName, GenerateName: dsName + "-", Labels: labels,
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "apps/v1", Kind: "DaemonSet", Name: dsName, UID: ds.UID, Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: "bare"}},
	} {
		p.Spec = corev1.PodSpec{Containers: []corev1.Container{{Name: "install", Image: "aether-node:test"}}}
		if _, err := cl.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Least privilege: exactly the rules README.md lists for the chart.
	if _, err := cl.Client.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "aether-cni-install"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
			{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{dsName}, Verbs: []string{"get"}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	token := func(sa string, bind bool) string {
		t.Helper()
		if _, err := cl.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if bind {
			if _, err := cl.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: sa},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "aether-cni-install"},
				Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: ns}},
			}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		tr, err := cl.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authv1.TokenRequest{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tr.Status.Token
	}
	owner := func(pod, tok string) *KubeOwner {
		return &KubeOwner{
			BaseURL: cl.Config.Host, Namespace: ns, Pod: pod,
			Token:  func() (string, error) { return tok, nil },
			Client: &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}, //nolint:gosec // test apiserver's self-signed cert
		}
	}
	installer := token("aether-cni-install", true)
	ask := func(k *KubeOwner, wantStays bool, wantWhy, wantErr string) {
		t.Helper()
		stays, why, err := k.DaemonSetStays(ctx)
		if wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), wantErr) {
				t.Fatalf("DaemonSetStays = %v, %q, %v; want an error containing %q", stays, why, err, wantErr)
			}
			t.Logf("no answer: %v", err)
			return
		}
		if err != nil || stays != wantStays || !strings.Contains(why, wantWhy) {
			t.Fatalf("DaemonSetStays = %v, %q, %v; want %v, %q", stays, why, err, wantStays, wantWhy)
		}
		t.Logf("answer: stays=%v (%s)", stays, why)
	}

	ask(owner(podName, installer), true, "DaemonSet aether-system/aether-node exists and is not being deleted", "")
	ask(owner("bare", installer), false, "not controlled by a DaemonSet", "")
	// A service account without the rules (its Role deleted by an
	// uninstall): the answer is "uninstall", not "no answer".
	ask(owner(podName, token("no-rules", false)), false, "403 Forbidden", "")

	// Deleted while a finalizer holds it: deletionTimestamp set.
	if err := cl.Client.AppsV1().DaemonSets(ns).Delete(ctx, dsName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	ask(owner(podName, installer), false, "is being deleted", "")
	patch := []byte(`{"metadata":{"finalizers":null}}`)
	if _, err := cl.Client.AppsV1().DaemonSets(ns).Patch(ctx, dsName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	ask(owner(podName, installer), false, "DaemonSet aether-system/aether-node is gone", "")

	cl.Stop()
	ask(owner(podName, installer), false, "", "failed to reach the API server")
}
