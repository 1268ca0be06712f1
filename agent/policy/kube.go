package policy

import (
	"context"
	"encoding/json"
	"log/slog"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// GVR is the resource the informer watches: security.istio.io/v1
// authorizationpolicies, cluster-wide; PeerGVR the peerauthentications.
var (
	GVR     = schema.GroupVersionResource{Group: Group, Version: "v1", Resource: ResourceAuthorizationPol}
	PeerGVR = schema.GroupVersionResource{Group: Group, Version: "v1", Resource: ResourcePeerAuthentication}
)

// RunInformer feeds m from the Kubernetes API until ctx ends. Until the
// cluster serves the AuthorizationPolicy CRD it checks again every
// interval (logged once): a cluster without Istio's CRDs simply has no
// policy.
func RunInformer(ctx context.Context, disc discovery.DiscoveryInterface, client dynamic.Interface, m *Model, interval time.Duration, log *slog.Logger) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	logged := false
	for !served(disc) {
		if !logged {
			log.Info("the cluster does not serve security.istio.io/v1 AuthorizationPolicy (CRD not installed): no authorization policy applies; checking again", "interval", interval.String())
			logged = true
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
	f := dynamicinformer.NewDynamicSharedInformerFactory(client, 0)
	inf := f.ForResource(GVR).Informer()
	handle := func(o any, deleted bool) {
		if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
			o = t.Obj
		}
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			return
		}
		if deleted {
			m.Delete(u.GetNamespace(), u.GetName())
			return
		}
		raw, err := json.Marshal(u.Object)
		if err != nil {
			log.Error("failed to encode authorization policy", "policy", u.GetNamespace()+"/"+u.GetName(), "error", err.Error())
			return
		}
		obj, err := ParseObject(raw)
		if obj == nil {
			log.Error("failed to read authorization policy", "policy", u.GetNamespace()+"/"+u.GetName(), "error", err.Error())
			return
		}
		m.Upsert(obj)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { handle(o, false) },
		UpdateFunc: func(_, o any) { handle(o, false) },
		DeleteFunc: func(o any) { handle(o, true) },
	}); err != nil {
		log.Error("failed to watch authorization policies", "error", err.Error())
		return
	}
	peers := f.ForResource(PeerGVR).Informer()
	handlePeer := func(o any, deleted bool) {
		if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
			o = t.Obj
		}
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			return
		}
		if deleted {
			m.DeletePeer(u.GetNamespace(), u.GetName())
			return
		}
		raw, err := json.Marshal(u.Object)
		if err != nil {
			return
		}
		p, err := ParsePeerObject(raw)
		if err != nil {
			log.Error("failed to read peer authentication; the level above applies", "policy", u.GetNamespace()+"/"+u.GetName(), "error", err.Error())
			return
		}
		m.UpsertPeer(p)
	}
	if _, err := peers.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { handlePeer(o, false) },
		UpdateFunc: func(_, o any) { handlePeer(o, false) },
		DeleteFunc: func(o any) { handlePeer(o, true) },
	}); err != nil {
		log.Error("failed to watch peer authentications", "error", err.Error())
		return
	}
	f.Start(ctx.Done())
	<-ctx.Done()
	f.Shutdown()
}

// served reports whether the API server serves the resource.
func served(disc discovery.DiscoveryInterface) bool {
	rl, err := disc.ServerResourcesForGroupVersion(GVR.GroupVersion().String())
	if err != nil {
		return false
	}
	for _, r := range rl.APIResources {
		if r.Name == GVR.Resource {
			return true
		}
	}
	return false
}
