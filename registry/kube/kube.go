// Package kube is the registry.Registry that spans nodes through the
// Kubernetes API, with nothing to run beside it: this node's endpoints are
// written by the agent as with the embedded backend, and every other node's
// mesh-managed pods are read from one cluster-wide, field-trimmed pod watch
// (plus a Node watch for their locality and a Namespace watch for the
// enrolment rules). It is the chart's default, so a
// multi-node cluster is one mesh out of the box; registry/etcd stays for
// operators who keep discovery off the API server. Costs and limits are in
// the package README.
package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"aether.io/node/pkg/enrolment"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// KeyPrefix starts the key of every endpoint read from the API (another
// node's pod): KeyPrefix + the pod's uid. This node's endpoints keep the
// sandbox IDs the agent registers them under.
const KeyPrefix = "pod/"

// nodeIndex indexes the pod informer by spec.nodeName.
const nodeIndex = "node"

// Options configure a Registry.
type Options struct {
	// Client reaches the API server.
	Client kubernetes.Interface
	// Node is this node's name: its pods come from Register, never from
	// the watch.
	Node string
	// Rules decide which pods are mesh-managed, as this node's agent
	// decides for its own (the pod's label, its namespace's, the system
	// namespaces, never served whatever their labels): every agent must
	// agree, or another node's namespace-enrolled pod is reached in
	// plaintext.
	Rules enrolment.Rules
	// Logger receives the backend's logs (nil: discarded).
	Logger *slog.Logger
}

// Registry is the Kubernetes-API registry. Build it with New, start its
// watches with Start, stop them with Close.
type Registry struct {
	opts  Options
	log   *slog.Logger
	store *local.Registry // this node's endpoints and every other node's

	pods       cache.SharedIndexInformer
	nodes      cache.SharedIndexInformer
	namespaces cache.SharedIndexInformer

	mu       sync.Mutex
	locality map[string]registry.Locality // node name -> its topology
	nsLabels map[string]map[string]string // namespace -> its labels
	cancel   context.CancelFunc
	done     chan struct{}
}

var _ registry.Registry = (*Registry)(nil)

// New builds the registry; it does no I/O until Start.
func New(o Options) (*Registry, error) {
	if o.Client == nil {
		return nil, errors.New("kube registry: no kubernetes client")
	}
	if o.Node == "" {
		return nil, errors.New("kube registry: node name is empty")
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	r := &Registry{opts: o, log: log, store: local.New(), locality: map[string]registry.Locality{}, nsLabels: map[string]map[string]string{}}
	// No resync timer: every change arrives as an event, and a resync would
	// only re-Put unchanged pods.
	r.pods = cache.NewSharedIndexInformer(r.podListWatch(), &corev1.Pod{}, 0, cache.Indexers{
		nodeIndex: func(obj any) ([]string, error) {
			if p, ok := obj.(*corev1.Pod); ok {
				return []string{p.Spec.NodeName}, nil
			}
			return nil, nil
		},
		cache.NamespaceIndex: cache.MetaNamespaceIndexFunc,
	})
	if err := r.pods.SetTransform(trimPod); err != nil {
		return nil, fmt.Errorf("kube registry: %w", err)
	}
	r.nodes = cache.NewSharedIndexInformer(listWatchAll[*corev1.NodeList](o.Client.CoreV1().Nodes()), &corev1.Node{}, 0, cache.Indexers{})
	if err := r.nodes.SetTransform(trimNode); err != nil {
		return nil, fmt.Errorf("kube registry: %w", err)
	}
	r.namespaces = cache.NewSharedIndexInformer(listWatchAll[*corev1.NamespaceList](o.Client.CoreV1().Namespaces()), &corev1.Namespace{}, 0, cache.Indexers{})
	if err := r.namespaces.SetTransform(trimNamespace); err != nil {
		return nil, fmt.Errorf("kube registry: %w", err)
	}
	return r, nil
}

// podListWatch lists and watches the running pods of every other node
// outside the system namespaces, but for those that opt out
// (aether.io/managed: "false"): a pod without the label is managed when its
// namespace is enrolled, which a label selector cannot say, so the rules
// decide here (the cache holds a trimmed pod, a few hundred bytes, per such
// pod of the cluster).
func (r *Registry) podListWatch() *cache.ListWatch {
	sel := []fields.Selector{
		fields.OneTermNotEqualSelector("spec.nodeName", r.opts.Node),
		fields.OneTermEqualSelector("status.phase", string(corev1.PodRunning)),
	}
	for _, ns := range r.opts.Rules.SystemNamespaces {
		sel = append(sel, fields.OneTermNotEqualSelector("metadata.namespace", ns))
	}
	fsel := fields.AndSelectors(sel...).String()
	lsel := enrolment.ManagedLabel + "!=false"
	pods := r.opts.Client.CoreV1().Pods(metav1.NamespaceAll)
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector, o.LabelSelector = fsel, lsel
			return pods.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector, o.LabelSelector = fsel, lsel
			return pods.Watch(ctx, o)
		},
	}
}

// lister is a typed client of one kind of object (Nodes(), Namespaces()).
type lister[L runtime.Object] interface {
	List(ctx context.Context, o metav1.ListOptions) (L, error)
	Watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error)
}

// listWatchAll lists and watches every object c serves: the Nodes (their
// locality) and the Namespaces (their labels enrol their pods).
func listWatchAll[L runtime.Object](c lister[L]) *cache.ListWatch {
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return c.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return c.Watch(ctx, o)
		},
	}
}

// trimPod keeps only what an endpoint is built from, so the informer's
// cache holds a few hundred bytes per pod instead of the whole object.
func trimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	t := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: p.Name, Namespace: p.Namespace, UID: p.UID, GenerateName: p.GenerateName,
			Labels: p.Labels, DeletionTimestamp: p.DeletionTimestamp, ResourceVersion: p.ResourceVersion,
		},
		Spec: corev1.PodSpec{
			NodeName: p.Spec.NodeName, ServiceAccountName: p.Spec.ServiceAccountName,
			DeprecatedServiceAccount: p.Spec.DeprecatedServiceAccount, HostNetwork: p.Spec.HostNetwork,
		},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIPs: p.Status.PodIPs, PodIP: p.Status.PodIP},
	}
	if ref := metav1.GetControllerOfNoCopy(p); ref != nil {
		t.OwnerReferences = []metav1.OwnerReference{*ref}
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			t.Status.Conditions = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	return t, nil
}

// trimNode keeps a Node's name and topology labels.
func trimNode(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	t := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, ResourceVersion: n.ResourceVersion, Labels: map[string]string{}}}
	for _, k := range []string{corev1.LabelTopologyRegion, corev1.LabelTopologyZone, SubzoneLabel} {
		if v, ok := n.Labels[k]; ok {
			t.Labels[k] = v
		}
	}
	return t, nil
}

// trimNamespace keeps a Namespace's name and labels.
func trimNamespace(obj any) (any, error) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: n.Name, ResourceVersion: n.ResourceVersion, Labels: n.Labels}}, nil
}

// SubzoneLabel is the Node label Istio reads a subzone from.
const SubzoneLabel = "topology.istio.io/subzone"

// Start runs the pod and Node watches until Close. Endpoints of other nodes
// appear in Watch and List as the watches deliver them.
func (r *Registry) Start() error {
	_, err := r.nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { r.onNode(o) },
		UpdateFunc: func(_, o any) { r.onNode(o) },
	})
	if err != nil {
		return fmt.Errorf("kube registry: failed to add node handler: %w", err)
	}
	_, err = r.namespaces.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { r.onNamespace(o, false) },
		UpdateFunc: func(_, o any) { r.onNamespace(o, false) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			r.onNamespace(o, true)
		},
	})
	if err != nil {
		return fmt.Errorf("kube registry: failed to add namespace handler: %w", err)
	}
	_, err = r.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { r.onPod(o) },
		UpdateFunc: func(_, o any) { r.onPod(o) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if p, ok := o.(*corev1.Pod); ok {
				r.deregister(KeyPrefix + string(p.UID))
			}
		},
	})
	if err != nil {
		return fmt.Errorf("kube registry: failed to add pod handler: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.mu.Lock()
	r.cancel, r.done = cancel, make(chan struct{})
	r.mu.Unlock()
	go func() {
		defer close(r.done)
		var wg sync.WaitGroup
		wg.Go(func() { r.nodes.RunWithContext(ctx) })
		wg.Go(func() { r.pods.RunWithContext(ctx) })
		wg.Go(func() { r.namespaces.RunWithContext(ctx) })
		if cache.WaitForCacheSync(ctx.Done(), r.nodes.HasSynced, r.pods.HasSynced, r.namespaces.HasSynced) {
			r.log.Info("kube registry synced", "node", r.opts.Node, "remote_endpoints", len(r.pods.GetStore().ListKeys()))
		}
		wg.Wait()
	}()
	return nil
}

// HasSynced reports whether the watches delivered their first listing.
func (r *Registry) HasSynced() bool {
	return r.nodes.HasSynced() && r.pods.HasSynced() && r.namespaces.HasSynced()
}

// Close stops the watches and waits for them.
func (r *Registry) Close() {
	r.mu.Lock()
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

func (r *Registry) onNode(o any) {
	n, ok := o.(*corev1.Node)
	if !ok {
		return
	}
	l := registry.Locality{Region: n.Labels[corev1.LabelTopologyRegion], Zone: n.Labels[corev1.LabelTopologyZone], Subzone: n.Labels[SubzoneLabel]}
	r.mu.Lock()
	changed := r.locality[n.Name] != l
	r.locality[n.Name] = l
	r.mu.Unlock()
	if !changed {
		return
	}
	// The node's pods carry its locality: rebuild them.
	objs, err := r.pods.GetIndexer().ByIndex(nodeIndex, n.Name)
	if err != nil {
		return
	}
	for _, p := range objs {
		r.onPod(p)
	}
}

// onNamespace records a namespace's labels (none once deleted) and, when
// they changed, decides again for its pods.
func (r *Registry) onNamespace(o any, deleted bool) {
	n, ok := o.(*corev1.Namespace)
	if !ok {
		return
	}
	r.mu.Lock()
	old, had := r.nsLabels[n.Name]
	if deleted {
		delete(r.nsLabels, n.Name)
	} else {
		r.nsLabels[n.Name] = n.Labels
	}
	r.mu.Unlock()
	if had && !deleted && maps.Equal(old, n.Labels) {
		return
	}
	objs, err := r.pods.GetIndexer().ByIndex(cache.NamespaceIndex, n.Name)
	if err != nil {
		return
	}
	for _, p := range objs {
		r.onPod(p)
	}
}

func (r *Registry) onPod(o any) {
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	key := KeyPrefix + string(p.UID)
	r.mu.Lock()
	loc := r.locality[p.Spec.NodeName]
	nsLabels := r.nsLabels[p.Namespace]
	r.mu.Unlock()
	ep, why := r.endpoint(p, loc, nsLabels)
	if why != "" {
		r.log.Debug("remote pod not served", "namespace", p.Namespace, "name", p.Name, "node", p.Spec.NodeName, "reason", why)
		r.deregister(key)
		return
	}
	if err := r.store.Register(context.Background(), ep); err != nil {
		r.log.Error("failed to store remote endpoint", "key", key, "error", err.Error())
	}
}

func (r *Registry) deregister(key string) {
	if err := r.store.Deregister(context.Background(), key); err != nil {
		r.log.Error("failed to remove remote endpoint", "key", key, "error", err.Error())
	}
}

// endpoint builds another node's pod as an endpoint, or says why it is not
// served: terminating (never re-registered, as the registry's invariant
// wants), a pod the selectors should have kept away (this node's, not
// running), or one the enrolment rules do not manage (with nsLabels, its
// namespace's labels).
func (r *Registry) endpoint(p *corev1.Pod, loc registry.Locality, nsLabels map[string]string) (registry.Endpoint, string) {
	ips := podIPs(p)
	switch {
	case p.DeletionTimestamp != nil:
		return registry.Endpoint{}, "terminating"
	case p.Spec.NodeName == r.opts.Node || p.Spec.NodeName == "":
		return registry.Endpoint{}, "not_another_node"
	case p.Status.Phase != corev1.PodRunning:
		return registry.Endpoint{}, "not_running"
	}
	d := r.opts.Rules.Decide(enrolment.Pod{
		Namespace: p.Namespace, Labels: p.Labels, NamespaceLabels: nsLabels, HostNetwork: p.Spec.HostNetwork, HasIPs: len(ips) > 0,
	})
	if !d.Managed {
		return registry.Endpoint{}, string(d.Reason)
	}
	sa := p.Spec.ServiceAccountName
	if sa == "" {
		sa = p.Spec.DeprecatedServiceAccount
	}
	ep := registry.Endpoint{
		Key: KeyPrefix + string(p.UID), Node: p.Spec.NodeName, Namespace: p.Namespace, Name: p.Name,
		UID: string(p.UID), IPs: ips, ServiceAccount: sa, Labels: p.Labels, HostNetwork: p.Spec.HostNetwork,
		FixedName: p.GenerateName == "", Healthy: ready(p), Locality: loc,
	}
	if ref := metav1.GetControllerOfNoCopy(p); ref != nil {
		ep.Owner = &registry.Owner{Kind: ref.Kind, Name: ref.Name}
	}
	return ep, ""
}

func podIPs(p *corev1.Pod) []netip.Addr {
	var out []netip.Addr
	add := func(s string) {
		a, err := netip.ParseAddr(s)
		if err == nil && !slices.Contains(out, a.Unmap()) {
			out = append(out, a.Unmap())
		}
	}
	for _, ip := range p.Status.PodIPs {
		add(ip.IP)
	}
	if len(out) == 0 && p.Status.PodIP != "" {
		add(p.Status.PodIP)
	}
	return out
}

func ready(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// Register stores one of this node's endpoints. Keys with KeyPrefix belong
// to the watch and are refused.
func (r *Registry) Register(ctx context.Context, ep registry.Endpoint) error {
	if strings.HasPrefix(ep.Key, KeyPrefix) {
		return fmt.Errorf("kube registry: key %q is reserved for other nodes' pods (prefix %q)", ep.Key, KeyPrefix)
	}
	return r.store.Register(ctx, ep)
}

// Deregister removes one of this node's endpoints.
func (r *Registry) Deregister(ctx context.Context, key string) error {
	if strings.HasPrefix(key, KeyPrefix) {
		return nil
	}
	return r.store.Deregister(ctx, key)
}

// Withdraw does nothing: like the embedded backend, nothing is written on
// this node's behalf once a call returns.
func (r *Registry) Withdraw(string) {}

// List returns every endpoint: this node's and every other node's the watch
// has delivered.
func (r *Registry) List(ctx context.Context) ([]registry.Endpoint, error) { return r.store.List(ctx) }

// ListNode returns this node's endpoints alone (what liveness reads).
func (r *Registry) ListNode(ctx context.Context) ([]registry.Endpoint, error) {
	all, err := r.store.List(ctx)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(all, func(ep registry.Endpoint) bool { return strings.HasPrefix(ep.Key, KeyPrefix) }), nil
}

// Watch sends every endpoint as a Put, then every change, until ctx ends.
// The pod watch's own restarts (a relist after a lost connection) turn into
// the Puts and Deletes of what changed meanwhile, so no change is dropped.
func (r *Registry) Watch(ctx context.Context) (<-chan registry.Event, error) {
	return r.store.Watch(ctx)
}

// WaitForSync blocks until both watches have listed once, or ctx ends.
func (r *Registry) WaitForSync(ctx context.Context) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	return cache.WaitForCacheSync(ctx.Done(), r.HasSynced)
}
