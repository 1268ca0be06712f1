// Package kube is the pod source backed by the Kubernetes API: one informer
// on this node's pods (fieldSelector spec.nodeName=<node>), with a direct GET
// on a cache miss so a pod created a moment ago is found at CNI ADD, and one
// on the cluster's namespaces, whose labels the enrolment rules read.
package kube

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"aether.io/node/agent/podsource"
	"aether.io/node/registry"
)

// Config loads a client config from kubeconfig, or the in-cluster config
// when kubeconfig is empty.
func Config(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("failed to load in-cluster config (pass --kubeconfig outside a cluster): %w", err)
		}
		return c, nil
	}
	c, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("failed to load kubeconfig %q: %w", kubeconfig, err)
	}
	return c, nil
}

// Source follows this node's pods through an informer.
type Source struct {
	client   kubernetes.Interface
	node     string
	log      *slog.Logger
	informer cache.SharedIndexInformer
	// nsInformer follows every namespace (list and watch namespaces):
	// their labels enrol pods.
	nsInformer cache.SharedIndexInformer
	synced     chan struct{}
}

var (
	_ podsource.Source     = (*Source)(nil)
	_ podsource.Namespaces = (*Source)(nil)
)

// New builds a source for node; it does no I/O until Run.
func New(client kubernetes.Interface, node string, resync time.Duration, log *slog.Logger) *Source {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	sel := fields.OneTermEqualSelector("spec.nodeName", node).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtimeObject, error) {
			o.FieldSelector = sel
			return client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watchInterface, error) {
			o.FieldSelector = sel
			return client.CoreV1().Pods(metav1.NamespaceAll).Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformer(lw, &corev1.Pod{}, resync, cache.Indexers{})
	nslw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtimeObject, error) {
			return client.CoreV1().Namespaces().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watchInterface, error) {
			return client.CoreV1().Namespaces().Watch(ctx, o)
		},
	}
	nsInf := cache.NewSharedIndexInformer(nslw, &corev1.Namespace{}, resync, cache.Indexers{})
	return &Source{client: client, node: node, log: log, informer: inf, nsInformer: nsInf, synced: make(chan struct{})}
}

// NamespaceLabels returns the labels of namespace name from the namespace
// informer's cache; false before the informer has seen it.
func (s *Source) NamespaceLabels(name string) (map[string]string, bool) {
	obj, ok, err := s.nsInformer.GetStore().GetByKey(name)
	if err != nil || !ok {
		return nil, false
	}
	return obj.(*corev1.Namespace).Labels, true
}

// Get returns the pod from the informer's cache, else from the API.
func (s *Source) Get(ctx context.Context, namespace, name string) (*podsource.Pod, error) {
	if obj, ok, err := s.informer.GetStore().GetByKey(namespace + "/" + name); err == nil && ok {
		return podsource.FromKube(obj.(*corev1.Pod)), nil
	}
	return s.Fetch(ctx, namespace, name)
}

// Fetch GETs the pod from the API server, bypassing the informer's cache.
func (s *Source) Fetch(ctx context.Context, namespace, name string) (*podsource.Pod, error) {
	p, err := s.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("failed to get pod %s/%s: %w", namespace, name, podsource.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("failed to get pod %s/%s: %w", namespace, name, err)
	}
	return podsource.FromKube(p), nil
}

// List returns the informer's pods.
func (s *Source) List() []*podsource.Pod {
	var out []*podsource.Pod
	for _, o := range s.informer.GetStore().List() {
		out = append(out, podsource.FromKube(o.(*corev1.Pod)))
	}
	podsource.SortPods(out)
	return out
}

// Synced is closed after both informers' first sync.
func (s *Source) Synced() <-chan struct{} { return s.synced }

// Run starts the informer and delivers its events to h until ctx ends.
func (s *Source) Run(ctx context.Context, h podsource.Handler) error {
	_, err := s.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(o any) {
			if p, ok := o.(*corev1.Pod); ok {
				h.OnPod(podsource.FromKube(p))
			}
		},
		UpdateFunc: func(_, o any) {
			if p, ok := o.(*corev1.Pod); ok {
				h.OnPod(podsource.FromKube(p))
			}
		},
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if p, ok := o.(*corev1.Pod); ok {
				h.OnDelete(podsource.FromKube(p))
			}
		},
	})
	if err != nil {
		return fmt.Errorf("failed to add pod event handler: %w", err)
	}
	go s.informer.RunWithContext(ctx)
	go s.nsInformer.RunWithContext(ctx)
	go func() {
		// Namespaces first: a pod is decided with its namespace's labels.
		if cache.WaitForCacheSync(ctx.Done(), s.nsInformer.HasSynced, s.informer.HasSynced) {
			close(s.synced)
			s.log.Info("pod source synced", "pod_source", "kubernetes", "node", s.node)
		}
	}()
	<-ctx.Done()
	return nil
}

// NodeLocality reads the node's topology labels; a missing Node gives an
// empty locality.
func NodeLocality(ctx context.Context, client kubernetes.Interface, node string) (registry.Locality, error) {
	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return registry.Locality{}, nil
	}
	if err != nil {
		return registry.Locality{}, fmt.Errorf("failed to get node %q: %w", node, err)
	}
	return registry.Locality{
		Region:  n.Labels[corev1.LabelTopologyRegion],
		Zone:    n.Labels[corev1.LabelTopologyZone],
		Subzone: n.Labels["topology.istio.io/subzone"],
	}, nil
}
