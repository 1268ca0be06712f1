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
	}
	if l := ep.Locality; l != (registry.Locality{}) {
		w.Locality = &workloadpb.Locality{Region: l.Region, Zone: l.Zone, Subzone: l.Subzone}
	}
	if err := Validate(w); err != nil {
		return nil, err
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

// workloadTypeAndName follows the owner chain the way Istio labels
// telemetry: a ReplicaSet's pods belong to its Deployment, a Job created by
// a CronJob to the CronJob; other controllers (StatefulSet, DaemonSet, ...)
// give their name with type POD; a bare pod is itself.
func workloadTypeAndName(ep registry.Endpoint) (workloadpb.WorkloadType, string) {
	if ep.Owner == nil || ep.Owner.Name == "" {
		return workloadpb.WorkloadType_POD, ep.Name
	}
	switch ep.Owner.Kind {
	case "ReplicaSet":
		if d, ok := deploymentOf(ep.Owner.Name, ep.Labels[labelPodTemplateHash]); ok {
			return workloadpb.WorkloadType_DEPLOYMENT, d
		}
		return workloadpb.WorkloadType_POD, ep.Owner.Name
	case "Deployment":
		return workloadpb.WorkloadType_DEPLOYMENT, ep.Owner.Name
	case "Job":
		if c, ok := cronJobOf(ep.Owner.Name); ok {
			return workloadpb.WorkloadType_CRONJOB, c
		}
		return workloadpb.WorkloadType_JOB, ep.Owner.Name
	case "CronJob":
		return workloadpb.WorkloadType_CRONJOB, ep.Owner.Name
	default:
		return workloadpb.WorkloadType_POD, ep.Owner.Name
	}
}

// deploymentOf strips the pod-template-hash suffix from a ReplicaSet name
// ("web-7d9f8c6b5" → "web"). With the pod's pod-template-hash label the
// suffix must match it; without, the last dash-separated segment must look
// like a template hash (lower-case alphanumerics).
func deploymentOf(rs, hash string) (string, bool) {
	if hash != "" {
		d, ok := strings.CutSuffix(rs, "-"+hash)
		return d, ok && d != ""
	}
	i := strings.LastIndexByte(rs, '-')
	if i <= 0 || i == len(rs)-1 {
		return "", false
	}
	for _, c := range rs[i+1:] {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return "", false
		}
	}
	return rs[:i], true
}

// cronJobOf recognises a Job created by a CronJob: the CronJob controller
// names it "<cronjob>-<scheduled time in minutes since the epoch>".
func cronJobOf(job string) (string, bool) {
	i := strings.LastIndexByte(job, '-')
	if i <= 0 {
		return "", false
	}
	suffix := job[i+1:]
	if len(suffix) < 8 {
		return "", false
	}
	for _, c := range suffix {
		if c < '0' || c > '9' {
			return "", false
		}
	}
	return job[:i], true
}

func canonicalName(labels map[string]string, workloadName string) string {
	for _, k := range []string{LabelCanonicalName, LabelAppName, labelApp} {
		if v := labels[k]; v != "" {
			return v
		}
	}
	return workloadName
}

func canonicalRevision(labels map[string]string) string {
	for _, k := range []string{LabelCanonicalRevision, LabelAppVersion, labelVersion} {
		if v := labels[k]; v != "" {
			return v
		}
	}
	return defaultRevision
}
