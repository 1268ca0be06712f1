package kube

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// typicalPod is a Deployment's pod as the API returns it, with the fields
// trimPod drops (managed fields, containers, status detail) filled in, so the
// measurement sees what the trim saves.
func typicalPod(i int) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: fmt.Sprintf("web-7d9f8c6b5-%05d", i), Namespace: "shop", UID: types.UID(fmt.Sprintf("0b7c9a1e-5d2f-4c3b-9a8e-%012d", i)),
			GenerateName: "web-7d9f8c6b5-", ResourceVersion: fmt.Sprint(100000 + i),
			Labels:          map[string]string{"aether.io/managed": "true", "app": "web", "version": "v1", "pod-template-hash": "7d9f8c6b5"},
			Annotations:     map[string]string{"kubectl.kubernetes.io/restartedAt": "2026-12-01T10:00:00Z"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "web-7d9f8c6b5", UID: "rs", Controller: ptr.To(true)}},
			ManagedFields:   []metav1.ManagedFieldsEntry{{Manager: "kube-controller-manager", Operation: "Update", APIVersion: "v1"}, {Manager: "kubelet", Operation: "Update", APIVersion: "v1", Subresource: "status"}},
		},
		Spec: corev1.PodSpec{
			NodeName: fmt.Sprintf("node-%04d", i%5000), ServiceAccountName: "web",
			Containers: []corev1.Container{{
				Name: "app", Image: "registry.example.com/shop/web:1.2.3", Ports: []corev1.ContainerPort{{ContainerPort: 8080}},
				Env: []corev1.EnvVar{{Name: "MODE", Value: "production"}},
			}},
		},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255),
			PodIPs:            []corev1.PodIP{{IP: fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)}},
			Conditions:        []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}, {Type: corev1.ContainersReady, Status: corev1.ConditionTrue}, {Type: corev1.PodScheduled, Status: corev1.ConditionTrue}},
			ContainerStatuses: []corev1.ContainerStatus{{Name: "app", Ready: true, Image: "registry.example.com/shop/web:1.2.3", ImageID: "sha256:0123456789abcdef"}},
		},
	}
}

// BenchmarkRemotePodMemory reports the heap one other node's pod costs this
// agent in the kube registry: the trimmed object in the informer's cache plus
// its endpoint in the store (bytes/pod; the README's 150,000-pod figure
// multiplies it). The pods are fed through the same transform and handler as
// the watch's, without an API server.
func BenchmarkRemotePodMemory(b *testing.B) {
	const n = 20000
	for b.Loop() {
		r, err := New(Options{Client: fake.NewClientset(), Node: "self"})
		if err != nil {
			b.Fatal(err)
		}
		store := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
		raw := make([]*corev1.Pod, n)
		for i := range raw {
			raw[i] = typicalPod(i)
		}
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for _, p := range raw {
			t, _ := trimPod(p)
			_ = store.Add(t)
			r.onPod(t)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		all, _ := r.List(context.Background())
		if len(all) != n {
			b.Fatalf("%d endpoints, want %d", len(all), n)
		}
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/n, "bytes/pod")
		runtime.KeepAlive(store)
		runtime.KeepAlive(raw)
	}
}
