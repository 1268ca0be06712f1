// Package handler is the server side of the agent's admin API
// (agent/adminapi): the HTTP handlers over the pod manager's records, with
// the SO_PEERCRED uid check (ConnContext), and View, which turns a record
// into the API's Pod.
package handler

import (
	"time"

	"aether.io/node/agent/adminapi"
	"aether.io/node/agent/pods"
)

// View renders a pod state as the admin API returns it.
func View(s pods.PodState) adminapi.Pod {
	r := s.Record
	p := r.Pod
	v := adminapi.Pod{
		Namespace: p.GetNamespace(), Name: p.GetName(), ContainerID: p.GetContainerId(), UID: p.GetUid(),
		IPs: p.GetIps(), NetworkNS: p.GetNetworkNamespace(), ServiceAccount: p.GetServiceAccount(), Labels: p.GetLabels(),
		Managed: true, Terminating: p.GetTerminating(), Registered: s.Registered, Healthy: s.Healthy,
		Uncaptured: r.Uncaptured, UncapturedError: r.UncapturedError, UDSPath: s.UDSPath, UDSRefusal: s.UDSRefusal,
		Volumes: p.GetVolumes(), UDSCSIVolume: p.GetUdsCsiVolume(), UDSCSIVolumes: p.GetUdsCsiVolumes(), AddedAt: r.AddedAt,
	}
	if t := r.LastTimings; t != nil {
		v.LastTimings = map[string]string{}
		if t.GetStarted() != nil {
			v.LastTimings["started"] = t.GetStarted().AsTime().Format(time.RFC3339Nano)
		}
		add := func(k string, set bool, d time.Duration) {
			if set {
				v.LastTimings[k] = d.String()
			}
		}
		add("pre_call", t.GetPreCall() != nil, t.GetPreCall().AsDuration())
		add("readiness_probe", t.GetReadinessProbe() != nil, t.GetReadinessProbe().AsDuration())
		add("capture_divert", t.GetCaptureDivert() != nil, t.GetCaptureDivert().AsDuration())
		add("total", t.GetTotal() != nil, t.GetTotal().AsDuration())
		if e := t.GetReadinessProbeError(); e != "" {
			v.LastTimings["readiness_probe_error"] = e
		}
		if e := t.GetCaptureDivertError(); e != "" {
			v.LastTimings["capture_divert_error"] = e
		}
	}
	return v
}
