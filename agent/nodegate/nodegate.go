// Package nodegate keeps pods off a node until its agent can answer AddPod:
// nodes register with the taint aether.io/agent-not-ready:NoSchedule
// (kubelet --register-with-taints), and the agent removes that taint from
// its own Node once its CNI socket serves and its pod source has synced.
//
// The removal patches only that taint: it reads the Node, drops every taint
// with the key and effect NoSchedule, and sends the remaining list with the
// Node's resourceVersion, so a concurrent change to the taints fails with a
// conflict and is read again instead of being overwritten. It is idempotent:
// a Node without the taint is left alone.
package nodegate

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// TaintKey is the key of the taint that keeps pods off a node whose agent
// is not ready; its effect is NoSchedule.
const TaintKey = "aether.io/agent-not-ready"

// Default retry bounds of Remove.
const (
	// DefaultInitialBackoff is the first wait after a failed attempt.
	DefaultInitialBackoff = 200 * time.Millisecond
	// DefaultMaxBackoff caps the doubling wait between attempts.
	DefaultMaxBackoff = 10 * time.Second
)

// Remover removes TaintKey from one Node.
type Remover struct {
	client kubernetes.Interface
	node   string
	log    *slog.Logger
	// InitialBackoff and MaxBackoff bound the wait between attempts
	// (defaults DefaultInitialBackoff and DefaultMaxBackoff).
	InitialBackoff, MaxBackoff time.Duration
}

// New returns a Remover for node; it does no I/O.
func New(client kubernetes.Interface, node string, log *slog.Logger) *Remover {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Remover{client: client, node: node, log: log, InitialBackoff: DefaultInitialBackoff, MaxBackoff: DefaultMaxBackoff}
}

// RunAfter waits until ready is closed, then removes the taint (Remove).
// It returns nil without touching the Node when ctx ends first.
func (r *Remover) RunAfter(ctx context.Context, ready <-chan struct{}) error {
	select {
	case <-ready:
	case <-ctx.Done():
		return nil
	}
	err := r.Remove(ctx)
	if ctx.Err() != nil {
		return nil // shutting down: not a failure of the agent
	}
	return err
}

// Remove removes the taint from the Node, retrying every failure (a
// conflict, an unreachable API server) with a doubling backoff until it
// succeeds or ctx ends; it then returns ctx's error.
func (r *Remover) Remove(ctx context.Context) error {
	wait := r.InitialBackoff
	for {
		removed, err := r.removeOnce(ctx)
		if err == nil {
			if removed {
				r.log.Info("removed node taint", "node", r.node, "taint", TaintKey)
			} else {
				r.log.Info("node taint already absent", "node", r.node, "taint", TaintKey)
			}
			return nil
		}
		if apierrors.IsConflict(err) {
			r.log.Debug("node changed while removing taint; retrying", "node", r.node, "error", err.Error())
		} else {
			r.log.Warn("failed to remove node taint; retrying", "node", r.node, "taint", TaintKey, "retry_in", wait.String(), "error", err.Error())
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("failed to remove taint %q from node %q: %w", TaintKey, r.node, ctx.Err())
		}
		wait = min(2*wait, r.MaxBackoff)
	}
}

// removeOnce reads the Node and, when it carries the taint, patches the
// taint list without it, guarded by the resourceVersion it read.
func (r *Remover) removeOnce(ctx context.Context) (removed bool, err error) {
	n, err := r.client.CoreV1().Nodes().Get(ctx, r.node, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("failed to get node %q: %w", r.node, err)
	}
	keep := make([]corev1.Taint, 0, len(n.Spec.Taints))
	for _, t := range n.Spec.Taints {
		if t.Key == TaintKey && t.Effect == corev1.TaintEffectNoSchedule {
			continue
		}
		keep = append(keep, t)
	}
	if len(keep) == len(n.Spec.Taints) {
		return false, nil
	}
	patch, err := taintsPatch(n.ResourceVersion, keep)
	if err != nil {
		return false, err
	}
	if _, err := r.client.CoreV1().Nodes().Patch(ctx, r.node, types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return false, fmt.Errorf("failed to patch taints of node %q: %w", r.node, err)
	}
	return true, nil
}

// taintsPatch is a strategic merge patch that sets the Node's taints to
// keep (the list has no merge key, so it replaces the list; null removes
// it) when the Node is still at resourceVersion rv.
func taintsPatch(rv string, keep []corev1.Taint) ([]byte, error) {
	var taints any = keep
	if len(keep) == 0 {
		taints = nil
	}
	b, err := json.Marshal(map[string]any{
		"metadata": map[string]any{"resourceVersion": rv},
		"spec":     map[string]any{"taints": taints},
	})
	if err != nil {
		return nil, fmt.Errorf("failed to encode taints patch: %w", err)
	}
	return b, nil
}
