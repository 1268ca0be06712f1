package app

import (
	"context"
	"time"

	"aether.io/node/registry"
)

// minLivenessListTimeout is the shortest deadline a liveness read gets,
// whatever --liveness-interval is.
const minLivenessListTimeout = time.Second

// nodeLister is a registry that can list this node's endpoints alone
// (registry/etcd reads only <prefix><node>/).
type nodeLister interface {
	ListNode(ctx context.Context) ([]registry.Endpoint, error)
}

// nodeView is the registry the pod manager gets. Its List is liveness's
// read of what is registered: it lists only this node's endpoints when the
// backend can, so a tick's cost does not grow with the cluster, and it is
// bounded by timeout, so a tick does not wait on an unreachable backend.
// Register and Deregister go to the backend unchanged.
type nodeView struct {
	registry.Registry
	timeout time.Duration
}

// livenessView returns reg as the pod manager sees it: List reads this
// node only, with a deadline of one liveness interval (at least
// minLivenessListTimeout).
func livenessView(reg registry.Registry, interval time.Duration) registry.Registry {
	return nodeView{Registry: reg, timeout: max(interval, minLivenessListTimeout)}
}

// List returns this node's endpoints (every endpoint if the backend cannot
// list one node, as the local one, which only holds this node's).
func (v nodeView) List(ctx context.Context) ([]registry.Endpoint, error) {
	ctx, cancel := context.WithTimeout(ctx, v.timeout)
	defer cancel()
	if nl, ok := v.Registry.(nodeLister); ok {
		return nl.ListNode(ctx)
	}
	return v.Registry.List(ctx)
}
