package services

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Informers feed a Model from the Kubernetes API: every Service and every
// EndpointSlice of the cluster (list and watch, nothing else), each
// trimmed to what the model reads before it is cached.
//
// Updates are coalesced: the handlers only record each object's last
// state in a pending batch and wake one worker, which hands the whole
// batch to the model (Model.Apply: each Service recomputed once). What
// arrives while the model applies a batch goes into the next one, so a
// storm of updates to one Service costs about one recompute per
// recompute's duration instead of one per update, and the last state
// always wins (a later update overwrites the pending one; none is
// dropped). No timer: a lone change is applied at once.
type Informers struct {
	q        *coalescer
	services cache.SharedIndexInformer
	slices   cache.SharedIndexInformer
	log      *slog.Logger
}

// NewInformers returns the informers of client feeding m. It does no I/O;
// call Run.
func NewInformers(client kubernetes.Interface, m *Model, log *slog.Logger) (*Informers, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	svcs := client.CoreV1().Services(metav1.NamespaceAll)
	ess := client.DiscoveryV1().EndpointSlices(metav1.NamespaceAll)
	i := &Informers{
		q: newCoalescer(m, m.met.Updates), log: log,
		services: cache.NewSharedIndexInformer(&cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return svcs.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return svcs.Watch(ctx, o)
			},
		}, &corev1.Service{}, 0, cache.Indexers{}),
		slices: cache.NewSharedIndexInformer(&cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return ess.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return ess.Watch(ctx, o)
			},
		}, &discoveryv1.EndpointSlice{}, 0, cache.Indexers{}),
	}
	if err := i.services.SetTransform(TrimService); err != nil {
		return nil, fmt.Errorf("service informer: %w", err)
	}
	if err := i.slices.SetTransform(TrimSlice); err != nil {
		return nil, fmt.Errorf("endpointslice informer: %w", err)
	}
	if _, err := i.services.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { i.onService(o, false) },
		UpdateFunc: func(_, o any) { i.onService(o, false) },
		DeleteFunc: func(o any) { i.onService(o, true) },
	}); err != nil {
		return nil, fmt.Errorf("service informer: %w", err)
	}
	if _, err := i.slices.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { i.onSlice(o, false) },
		UpdateFunc: func(_, o any) { i.onSlice(o, false) },
		DeleteFunc: func(o any) { i.onSlice(o, true) },
	}); err != nil {
		return nil, fmt.Errorf("endpointslice informer: %w", err)
	}
	return i, nil
}

func deletedObject(o any) any {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return o
}

func (i *Informers) onService(o any, deleted bool) {
	svc, ok := deletedObject(o).(*corev1.Service)
	if !ok {
		return
	}
	k := key(svc.Namespace, svc.Name)
	if deleted {
		svc = nil
	}
	i.q.record(func(b Batch) { b.Services[k] = svc })
}

func (i *Informers) onSlice(o any, deleted bool) {
	es, ok := deletedObject(o).(*discoveryv1.EndpointSlice)
	if !ok {
		return
	}
	k := key(es.Namespace, es.Name)
	if deleted {
		es = nil
	}
	i.q.record(func(b Batch) { b.Slices[k] = es })
}

// replace makes the model hold exactly the caches' content: what a
// snapshot restored before the API answered and the API no longer has
// goes.
func (i *Informers) replace(m applier) {
	var svcs []*corev1.Service
	for _, o := range i.services.GetStore().List() {
		if s, ok := o.(*corev1.Service); ok {
			svcs = append(svcs, s)
		}
	}
	var ess []*discoveryv1.EndpointSlice
	for _, o := range i.slices.GetStore().List() {
		if es, ok := o.(*discoveryv1.EndpointSlice); ok {
			ess = append(ess, es)
		}
	}
	m.Replace(svcs, ess)
	i.log.Info("services synced", "services", len(svcs), "endpointslices", len(ess))
}

// HasSynced reports whether both informers delivered their first listing.
func (i *Informers) HasSynced() bool { return i.services.HasSynced() && i.slices.HasSynced() }

// Run runs the informers and the worker applying their updates until ctx
// ends.
func (i *Informers) Run(ctx context.Context) {
	synced := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { i.q.run(ctx, synced, i.replace) })
	wg.Go(func() { i.services.RunWithContext(ctx) })
	wg.Go(func() { i.slices.RunWithContext(ctx) })
	if cache.WaitForCacheSync(ctx.Done(), i.HasSynced) {
		close(synced)
	}
	wg.Wait()
}

// applier is what the coalescer feeds: the Model.
type applier interface {
	Apply(Batch)
	Replace([]*corev1.Service, []*discoveryv1.EndpointSlice)
}

// coalescer merges the informers' updates into batches for one worker
// (see Informers).
type coalescer struct {
	model   applier
	updates prometheus.Counter // nil: not counted

	mu      sync.Mutex
	pending Batch
	wake    chan struct{} // one token: the pending batch may not be empty
}

func newCoalescer(m applier, updates prometheus.Counter) *coalescer {
	return &coalescer{model: m, updates: updates, pending: newBatch(), wake: make(chan struct{}, 1)}
}

func newBatch() Batch {
	return Batch{Services: map[string]*corev1.Service{}, Slices: map[string]*discoveryv1.EndpointSlice{}}
}

// record sets an object's last state in the pending batch and wakes the
// worker.
func (q *coalescer) record(set func(Batch)) {
	if q.updates != nil {
		q.updates.Inc()
	}
	q.mu.Lock()
	set(q.pending)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default: // already woken: the worker takes this change with the others
	}
}

// take returns the pending batch and starts a new one.
func (q *coalescer) take() Batch {
	q.mu.Lock()
	defer q.mu.Unlock()
	b := q.pending
	q.pending = newBatch()
	return b
}

// run is the one goroutine that writes the model, until ctx ends: it
// applies the pending batch whenever there is one, and once synced is
// closed, replace (the caches' whole content; nil: nothing).
func (q *coalescer) run(ctx context.Context, synced <-chan struct{}, replace func(applier)) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-synced:
			synced = nil
			// The caches hold everything recorded so far (an informer
			// updates its cache before it calls the handlers), and what
			// comes later is recorded again.
			q.take()
			if replace != nil {
				replace(q.model)
			}
		case <-q.wake:
			if b := q.take(); b.Len() > 0 {
				q.model.Apply(b)
			}
		}
	}
}

// TrimService keeps what BuildService reads.
func TrimService(obj any) (any, error) {
	s, ok := obj.(*corev1.Service)
	if !ok {
		return obj, nil
	}
	t := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: s.Name, Namespace: s.Namespace, ResourceVersion: s.ResourceVersion},
		Spec: corev1.ServiceSpec{
			Type: s.Spec.Type, ClusterIP: s.Spec.ClusterIP, ClusterIPs: s.Spec.ClusterIPs, Ports: s.Spec.Ports,
			PublishNotReadyAddresses: s.Spec.PublishNotReadyAddresses, TrafficDistribution: s.Spec.TrafficDistribution,
		},
	}
	if v, ok := s.Annotations[AnnotationTrafficDistribution]; ok {
		t.Annotations = map[string]string{AnnotationTrafficDistribution: v}
	}
	return t, nil
}

// TrimSlice keeps what SliceEndpoints reads.
func TrimSlice(obj any) (any, error) {
	es, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	t := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: es.Name, Namespace: es.Namespace, ResourceVersion: es.ResourceVersion},
		AddressType: es.AddressType, Ports: es.Ports,
	}
	if v, ok := es.Labels[LabelServiceName]; ok {
		t.Labels = map[string]string{LabelServiceName: v}
	}
	t.Endpoints = make([]discoveryv1.Endpoint, len(es.Endpoints))
	for n, e := range es.Endpoints {
		t.Endpoints[n] = discoveryv1.Endpoint{Addresses: e.Addresses, Conditions: e.Conditions, NodeName: e.NodeName}
		if e.TargetRef != nil {
			t.Endpoints[n].TargetRef = &corev1.ObjectReference{Kind: e.TargetRef.Kind, Namespace: e.TargetRef.Namespace, Name: e.TargetRef.Name}
		}
	}
	return t, nil
}
