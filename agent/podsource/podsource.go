// Package podsource defines where the agent learns what the CNI cannot see
// about a pod (labels, annotations, uid, service account, deletionTimestamp,
// volumes, owner) and how it follows changes. Two implementations exist: the
// Kubernetes API (podsource/kube) and a watched directory of Pod manifests
// (podsource/manifests) for standalone nodes.
package podsource

import (
	"context"
	"errors"
	"slices"
	"sort"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/pkg/meshcontract"
	"aether.io/node/registry"
)

// CSIDriver is the CSI driver whose inline ephemeral volumes carry a pod's
// UDS-delivered socket (meshcontract.CSIDriver, shared with aether-csi).
const CSIDriver = meshcontract.CSIDriver

// ErrNotFound is returned by Get when the source does not know the pod (yet).
var ErrNotFound = errors.New("pod not found")

// Pod is what the agent takes from a pod source.
type Pod struct {
	Namespace      string
	Name           string
	UID            string
	NodeName       string
	ServiceAccount string
	Labels         map[string]string
	Annotations    map[string]string
	// Terminating is true once deletionTimestamp is set.
	Terminating bool
	// Volumes names every volume the pod declares.
	Volumes []string
	// UDSCSIVolume is the name of the single inline csi.aether.io volume;
	// empty when there is none or more than one.
	UDSCSIVolume string
	// UDSCSIVolumes counts the inline csi.aether.io volumes.
	UDSCSIVolumes uint32
	// DeclaredTCPPorts are the TCP ports (protocol TCP or unset) the
	// pod's containers and restartable init containers (sidecars)
	// declare, ascending, each once; empty when they declare none.
	DeclaredTCPPorts []uint32
	// Owner is the controlling owner reference, if any.
	Owner *registry.Owner
	// HostNetwork is spec.hostNetwork.
	HostNetwork bool
	// FixedName is true when the pod's name was not generated
	// (metadata.generateName empty): istiod then names the workload after
	// the pod whatever its owner (xds/workload).
	FixedName bool
}

// ID returns "namespace/name".
func (p *Pod) ID() string { return p.Namespace + "/" + p.Name }

// Handler receives a source's changes. Calls are serialised per source.
type Handler interface {
	// OnPod is called for every added or changed pod.
	OnPod(p *Pod)
	// OnDelete is called when a pod is gone from the source (deleted,
	// force-deleted, or its manifest removed).
	OnDelete(p *Pod)
}

// Source is one pod source.
type Source interface {
	// Get returns the pod, or ErrNotFound. It does not wait for the pod to
	// appear; callers retry within their deadline.
	Get(ctx context.Context, namespace, name string) (*Pod, error)
	// Fetch reads the pod from the source's authority, bypassing any
	// cache (the API server for kube, the directory for manifests), or
	// returns ErrNotFound. The agent calls it once when Get's answer is
	// for another pod than the runtime's sandbox (a different uid: the
	// cache still holds a deleted pod of the same name). ctx bounds it.
	Fetch(ctx context.Context, namespace, name string) (*Pod, error)
	// Run follows the source and calls h until ctx ends. It returns nil on
	// ctx end and an error only if it cannot start.
	Run(ctx context.Context, h Handler) error
	// Synced is closed once the first full listing has been delivered to h.
	Synced() <-chan struct{}
	// List returns every pod the source currently knows (after Synced).
	List() []*Pod
}

// Namespaces knows the labels of the namespaces, which the enrolment rules
// read (a namespace labelled aether.io/managed: "true" enrols its pods).
// Both sources implement it.
type Namespaces interface {
	// NamespaceLabels returns namespace name's labels, and false when the
	// source does not know the namespace (yet).
	NamespaceLabels(name string) (map[string]string, bool)
}

// FromKube converts a Kubernetes Pod.
func FromKube(k *corev1.Pod) *Pod {
	p := &Pod{
		Namespace:      k.Namespace,
		Name:           k.Name,
		UID:            string(k.UID),
		NodeName:       k.Spec.NodeName,
		ServiceAccount: k.Spec.ServiceAccountName,
		Labels:         copyMap(k.Labels),
		Annotations:    copyMap(k.Annotations),
		Terminating:    k.DeletionTimestamp != nil,
		HostNetwork:    k.Spec.HostNetwork,
		FixedName:      k.GenerateName == "",
	}
	if p.ServiceAccount == "" {
		p.ServiceAccount = k.Spec.DeprecatedServiceAccount // older manifests set only the deprecated field
	}
	for _, v := range k.Spec.Volumes {
		p.Volumes = append(p.Volumes, v.Name)
		if v.CSI != nil && v.CSI.Driver == CSIDriver {
			p.UDSCSIVolumes++
			p.UDSCSIVolume = v.Name
		}
	}
	if p.UDSCSIVolumes != 1 {
		p.UDSCSIVolume = ""
	}
	p.DeclaredTCPPorts = declaredTCPPorts(&k.Spec)
	if ref := metav1.GetControllerOfNoCopy(k); ref != nil {
		p.Owner = &registry.Owner{Kind: ref.Kind, Name: ref.Name}
	}
	return p
}

// declaredTCPPorts returns the TCP container ports of the pod's containers
// and of its restartable init containers (sidecars: restartPolicy Always,
// which run beside the app and may serve), ascending, each once. UDP and
// SCTP ports are left out (HBONE carries TCP only); so are other init
// containers, which are done before the app starts, and ephemeral
// containers, which cannot declare ports.
func declaredTCPPorts(spec *corev1.PodSpec) []uint32 {
	var out []uint32
	add := func(cs []corev1.Container, sidecarsOnly bool) {
		for i := range cs {
			c := &cs[i]
			if sidecarsOnly && (c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways) {
				continue
			}
			for _, cp := range c.Ports {
				if (cp.Protocol == "" || cp.Protocol == corev1.ProtocolTCP) && cp.ContainerPort > 0 && cp.ContainerPort <= 65535 {
					out = append(out, uint32(cp.ContainerPort))
				}
			}
		}
	}
	add(spec.InitContainers, true)
	add(spec.Containers, false)
	slices.Sort(out)
	return slices.Compact(out)
}

func copyMap(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// SortPods sorts by namespace/name.
func SortPods(ps []*Pod) {
	sort.Slice(ps, func(i, j int) bool { return ps[i].ID() < ps[j].ID() })
}
