package workload

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/registry"
)

// Label keys the builder reads canonical names and revisions from, in the
// order Istio consults them.
const (
	LabelCanonicalName     = "service.istio.io/canonical-name"
	LabelCanonicalRevision = "service.istio.io/canonical-revision"
	LabelAppName           = "app.kubernetes.io/name"
	LabelAppVersion        = "app.kubernetes.io/version"
	labelApp               = "app"
	labelVersion           = "version"
	labelPodTemplateHash   = "pod-template-hash"
	defaultRevision        = "latest"
)

// Config is the mesh-wide part of every workload the builder emits.
type Config struct {
	// ClusterID is the cluster name; it is the first segment of every uid and
	// the workload's cluster_id. Required.
	ClusterID string
	// TrustDomain is the SPIFFE trust domain (for example cluster.local).
	TrustDomain string
	// Network is the network the pods' addresses belong to; empty for the
	// default network.
	Network string
	// HBONE marks every workload that is not host-network tunnel_protocol:
	// HBONE (its proxy serves HBONE on the pod's :15008, proxy/hbone). Off
	// until the data plane serves that listener: a consumer such as ztunnel
	// would otherwise tunnel to pods that cannot accept it.
	HBONE bool
	// ObserveLabels, when set, is told every built workload's uid,
	// namespace and labels (the labels are shared: do not modify them):
	// the policy model matches AuthorizationPolicy selectors with them,
	// which the Workload resource does not carry.
	ObserveLabels func(uid, namespace string, labels map[string]string)
}

// UID returns the workload uid of the pod namespace/name in cluster:
// "<cluster>//Pod/<namespace>/<name>", the format istiod uses.
func UID(cluster, namespace, name string) string {
	return cluster + "//Pod/" + namespace + "/" + name
}

// Build turns a registered endpoint into the istio.workload.Workload served
// for it. It fails when the endpoint cannot form a valid workload: no
// namespace or name, or no usable address.
func Build(cfg Config, ep registry.Endpoint) (*workloadpb.Workload, error) {
	if cfg.ClusterID == "" {
		return nil, errors.New("failed to build workload: cluster ID is empty; set the cluster name")
	}
	if ep.Namespace == "" || ep.Name == "" {
		return nil, fmt.Errorf("failed to build workload for endpoint %q: namespace and name are required, got %q/%q", ep.Key, ep.Namespace, ep.Name)
	}
	addrs, err := rawAddresses(ep.IPs)
	if err != nil {
		return nil, fmt.Errorf("failed to build workload %q: %w", ep.Namespace+"/"+ep.Name, err)
	}
	wtype, wname := workloadTypeAndName(ep)
	w := &workloadpb.Workload{
		Uid:               UID(cfg.ClusterID, ep.Namespace, ep.Name),
		Name:              ep.Name,
		Namespace:         ep.Namespace,
		Addresses:         addrs,
		Network:           cfg.Network,
		TrustDomain:       cfg.TrustDomain,
		ServiceAccount:    ep.ServiceAccount,
		Node:              ep.Node,
		CanonicalName:     canonicalName(ep.Labels, wname),
		CanonicalRevision: canonicalRevision(ep.Labels),
		WorkloadType:      wtype,
		WorkloadName:      wname,
		ClusterId:         cfg.ClusterID,
		Status:            workloadpb.WorkloadStatus_UNHEALTHY,
	}
	if ep.Healthy {
		w.Status = workloadpb.WorkloadStatus_HEALTHY
	}
	if ep.HostNetwork {
		w.NetworkMode = workloadpb.NetworkMode_HOST_NETWORK
	} else if cfg.HBONE {
		// Host-network pods share the node's netns: no per-pod :15008.
		w.TunnelProtocol = workloadpb.TunnelProtocol_HBONE
	}
	if l := ep.Locality; l != (registry.Locality{}) {
		w.Locality = &workloadpb.Locality{Region: l.Region, Zone: l.Zone, Subzone: l.Subzone}
	}
	if err := Validate(w); err != nil {
		return nil, err
	}
	if cfg.ObserveLabels != nil {
		cfg.ObserveLabels(w.GetUid(), ep.Namespace, ep.Labels)
	}
	return w, nil
}

// Validate checks the rules of the Workload resource that the builder and
// any other producer must keep: a uid, and at least one address (raw 4- or
// 16-byte IP) or a hostname.
func Validate(w *workloadpb.Workload) error {
	if w.GetUid() == "" {
		return errors.New("invalid workload: uid is empty")
	}
	if len(w.GetAddresses()) == 0 && w.GetHostname() == "" {
		return fmt.Errorf("invalid workload %q: it needs at least one address or a hostname", w.GetUid())
	}
	for _, a := range w.GetAddresses() {
		if len(a) != 4 && len(a) != 16 {
			return fmt.Errorf("invalid workload %q: address of %d bytes, want 4 (IPv4) or 16 (IPv6)", w.GetUid(), len(a))
		}
	}
	return nil
}

// rawAddresses renders IPs as the raw bytes clients index by: 4 bytes for
// IPv4 (also IPv4-mapped IPv6), 16 for IPv6, in the given order without
// duplicates.
func rawAddresses(ips []netip.Addr) ([][]byte, error) {
	if len(ips) == 0 {
		return nil, errors.New("pod has no IP address; a workload needs at least one")
	}
	out := make([][]byte, 0, len(ips))
	seen := make(map[netip.Addr]struct{}, len(ips))
	for _, ip := range ips {
		if !ip.IsValid() {
			return nil, errors.New("pod has an invalid (zero) IP address")
		}
		ip = ip.Unmap().WithZone("")
		if _, dup := seen[ip]; dup {
			continue
		}
		seen[ip] = struct{}{}
		out = append(out, ip.AsSlice())
	}
	return out, nil
}

// workloadTypeAndName names the workload as istiod's ambient workload
// builder does (istio.io/istio pilot/pkg/serviceregistry/kube/controller/
// ambient workloadNameAndType over pkg/kube GetDeployMetaFromPod):
//   - a pod whose name was not generated (FixedName), or without a
//     controlling owner, is its own workload: POD, the pod's name;
//   - a ReplicaSet whose name ends with the pod's pod-template-hash label is
//     a Deployment's: DEPLOYMENT, the name without "-<hash>";
//   - a Job named "<name>-<8 to 10 digits>" was created by a CronJob:
//     CRONJOB, <name>; any other Job: JOB, the Job's name;
//   - a Deployment or CronJob owning the pod directly: that type and name;
//   - anything else (StatefulSet, DaemonSet, a ReplicaSet without the hash,
//     ReplicationController, Argo Rollout, ...): POD, the pod's name.
//
// istiod's ambient builder applies no label override to the workload
// name (the service.istio.io/workload-name label is read by
// GetWorkloadMetaFromPod, which the ambient builder does not use); labels
// only pick the canonical name and revision (canonicalName).
func workloadTypeAndName(ep registry.Endpoint) (workloadpb.WorkloadType, string) {
	if ep.FixedName || ep.Owner == nil {
		return workloadpb.WorkloadType_POD, ep.Name
	}
	wtype, name := workloadpb.WorkloadType_POD, ""
	switch owner := ep.Owner.Name; ep.Owner.Kind {
	case "ReplicaSet":
		// As istiod: the suffix test is on the hash, the trim on "-<hash>".
		if hash := ep.Labels[labelPodTemplateHash]; hash != "" && strings.HasSuffix(owner, hash) {
			wtype, name = workloadpb.WorkloadType_DEPLOYMENT, strings.TrimSuffix(owner, "-"+hash)
		}
	case "Job":
		wtype, name = workloadpb.WorkloadType_JOB, owner
		if c, ok := cronJobOf(owner); ok {
			wtype, name = workloadpb.WorkloadType_CRONJOB, c
		}
	case "Deployment":
		wtype, name = workloadpb.WorkloadType_DEPLOYMENT, owner
	case "CronJob":
		wtype, name = workloadpb.WorkloadType_CRONJOB, owner
	}
	if wtype == workloadpb.WorkloadType_POD || name == "" {
		// Every other kind is named after the pod, and so is a workload
		// whose derived name is empty (GetDeployMetaFromPod's fallback).
		name = ep.Name
	}
	return wtype, name
}

// cronJobOf recognises a Job created by a CronJob as istiod does: a name
// "<cronjob>-<8 to 10 digits>" (the CronJob controller appends the
// scheduled time in minutes since the epoch), <cronjob> not empty.
func cronJobOf(job string) (string, bool) {
	i := strings.LastIndexByte(job, '-')
	if i <= 0 {
		return "", false
	}
	suffix := job[i+1:]
	if len(suffix) < 8 || len(suffix) > 10 {
		return "", false
	}
	for _, c := range suffix {
		if c < '0' || c > '9' {
			return "", false
		}
	}
	return job[:i], true
}

// canonicalName and canonicalRevision follow istio.io/istio pkg/kube/labels
// CanonicalService: the first of the labels that is present (even with an
// empty value) wins; the name falls back to the workload name, the revision
// to "latest".
func canonicalName(labels map[string]string, workloadName string) string {
	if v, ok := firstLabel(labels, LabelCanonicalName, LabelAppName, labelApp); ok {
		return v
	}
	return workloadName
}

func canonicalRevision(labels map[string]string) string {
	if v, ok := firstLabel(labels, LabelCanonicalRevision, LabelAppVersion, labelVersion); ok {
		return v
	}
	return defaultRevision
}

func firstLabel(labels map[string]string, keys ...string) (string, bool) {
	for _, k := range keys {
		if v, ok := labels[k]; ok {
			return v, true
		}
	}
	return "", false
}
