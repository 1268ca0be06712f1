package deploy_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"aether.io/node/agent/nodegate"
	"aether.io/node/deploy/chart"
	"aether.io/node/test/kubetest"
)

// nodeNameExtra is the user-info extra of a pod-bound ServiceAccount token
// that names the pod's node (Kubernetes 1.30+).
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// TestNodePatchOwnNodeOnly installs the default render's ServiceAccount,
// RBAC and node patch policy on a real kube-apiserver and acts as the agent
// with a token bound to a pod on node-a (a TokenRequest, as kubelet makes
// for the projected token): the agent's own taint removal (nodegate)
// succeeds on node-a; removing the taint from node-b, adding a taint,
// removing another taint or changing a label of node-a are denied; an
// administrator is not affected.
func TestNodePatchOwnNodeOnly(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	cl.Namespace(t, chart.Namespace)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := cl.Client
	r := renderSet(t, valueSets[0])
	sa := r.ds.Spec.Template.Spec.ServiceAccountName
	for _, o := range r.objs {
		var err error
		switch x := o.(type) {
		case *corev1.ServiceAccount:
			_, err = admin.CoreV1().ServiceAccounts(x.Namespace).Create(ctx, x, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = admin.RbacV1().ClusterRoles().Create(ctx, x, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = admin.RbacV1().ClusterRoleBindings().Create(ctx, x, metav1.CreateOptions{})
		case *admissionv1.ValidatingAdmissionPolicy:
			_, err = admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, x, metav1.CreateOptions{})
		case *admissionv1.ValidatingAdmissionPolicyBinding:
			_, err = admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, x, metav1.CreateOptions{})
		}
		if err != nil {
			t.Fatalf("failed to create %T: %v", o, err)
		}
	}
	gate := corev1.Taint{Key: nodegate.TaintKey, Effect: corev1.TaintEffectNoSchedule}
	other := corev1.Taint{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule}
	// The taints each node was created with (the API server's admission
	// adds node.kubernetes.io/not-ready): what nodegate must leave.
	created := map[string][]corev1.Taint{}
	for _, name := range []string{"node-a", "node-b"} {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{Taints: []corev1.Taint{gate, other}}}
		n, err := admin.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		created[name] = n.Spec.Taints
	}
	no := false
	pod, err := admin.CoreV1().Pods(chart.Namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "aether-node-test"},
		Spec: corev1.PodSpec{
			ServiceAccountName: sa, NodeName: "node-a", AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{Name: "agent", Image: "localhost/aether-node:test"}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := admin.CoreV1().ServiceAccounts(chart.Namespace).CreateToken(ctx, sa, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rc := rest.CopyConfig(cl.Config)
	rc.BearerToken = tr.Status.Token
	agent, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	// The policy relies on the node name in the pod-bound token.
	review, err := agent.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := review.Status.UserInfo.Extra[nodeNameExtra]; !slices.Equal(got, authnv1.ExtraValue{"node-a"}) {
		t.Fatalf("the pod-bound token's user info extra %s = %q, want [node-a] (user info %+v)", nodeNameExtra, got, review.Status.UserInfo)
	}

	patchTaints := func(c kubernetes.Interface, node string, dryRun bool, taints ...corev1.Taint) error {
		b, _ := json.Marshal(map[string]any{"spec": map[string]any{"taints": taints}})
		opts := metav1.PatchOptions{}
		if dryRun {
			opts.DryRun = []string{metav1.DryRunAll}
		}
		_, err := c.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, b, opts)
		return err
	}
	sameTaint := func(a, b corev1.Taint) bool { return a.Key == b.Key && a.Effect == b.Effect }
	// without is the node's creation taints less t.
	without := func(node string, t corev1.Taint) []corev1.Taint {
		return slices.DeleteFunc(slices.Clone(created[node]), func(x corev1.Taint) bool { return sameTaint(x, t) })
	}
	policy := r.ds.Name + "-own-node"
	deniedByPolicy := func(err error) bool { return err != nil && strings.Contains(err.Error(), policy) }
	// Each attempt below breaks one rule of the policy; its message names
	// which.
	deniedFor := func(err error, rule string) bool { return deniedByPolicy(err) && strings.Contains(err.Error(), rule) }
	// A new policy takes effect once the API server's admission has
	// loaded it: wait with dry runs.
	for deadline := time.Now().Add(time.Minute); ; {
		err := patchTaints(agent, "node-b", true, without("node-b", gate)...)
		if deniedByPolicy(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent's token may still remove the taint of node-b after a minute (error %v): the policy %s does not act", err, policy)
		}
		time.Sleep(200 * time.Millisecond)
	}

	if err := patchTaints(agent, "node-b", false, without("node-b", gate)...); !deniedFor(err, "only its own Node") {
		t.Errorf("removing the taint from another node: error %v, want a denial by %s for the node", err, policy)
	}
	added := append(slices.Clone(created["node-a"]), corev1.Taint{Key: "example.com/new", Effect: corev1.TaintEffectNoExecute})
	if err := patchTaints(agent, "node-a", false, added...); !deniedFor(err, "only remove the taint") {
		t.Errorf("adding a taint to its own node: error %v, want a denial by %s for the taints", err, policy)
	}
	if err := patchTaints(agent, "node-a", false, without("node-a", other)...); !deniedFor(err, "only remove the taint") {
		t.Errorf("removing another taint from its own node: error %v, want a denial by %s for the taints", err, policy)
	}
	label := []byte(`{"metadata":{"labels":{"node-role.kubernetes.io/control-plane":""}}}`)
	if _, err := agent.CoreV1().Nodes().Patch(ctx, "node-a", types.StrategicMergePatchType, label, metav1.PatchOptions{}); !deniedFor(err, "change nothing of a Node") {
		t.Errorf("labelling its own node: error %v, want a denial by %s for the labels", err, policy)
	}
	spec := []byte(`{"spec":{"unschedulable":true}}`)
	if _, err := agent.CoreV1().Nodes().Patch(ctx, "node-a", types.StrategicMergePatchType, spec, metav1.PatchOptions{}); !deniedFor(err, "change nothing of a Node") {
		t.Errorf("cordoning its own node: error %v, want a denial by %s for the spec", err, policy)
	}

	// The agent's own removal goes through.
	rm := nodegate.New(agent, "node-a", nil)
	rm.InitialBackoff, rm.MaxBackoff = 50*time.Millisecond, 500*time.Millisecond
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	defer rcancel()
	if err := rm.Remove(rctx); err != nil {
		t.Fatalf("nodegate with the pod's token: %v", err)
	}
	for name, want := range map[string][]corev1.Taint{"node-a": without("node-a", gate), "node-b": created["node-b"]} {
		n, err := admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.EqualFunc(n.Spec.Taints, want, sameTaint) {
			t.Errorf("%s taints %+v, want %+v", name, n.Spec.Taints, want)
		}
	}
	// Other users are not matched.
	if _, err := admin.CoreV1().Nodes().Patch(ctx, "node-b", types.StrategicMergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Errorf("the policy must leave other users alone: an administrator's label patch failed: %v", err)
	}
}
