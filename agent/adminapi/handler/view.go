// Package handler is the server side of the agent's admin API
// (agent/adminapi): the HTTP handlers over the pod manager's records, with
// the SO_PEERCRED uid check (ConnContext), and View, which turns a record
// into the API's Pod.
package handler

import (
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"aether.io/node/agent/pods"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/enrolment"
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
	if v.EnrolledVia = r.EnrolledVia; v.EnrolledVia == "" {
		v.EnrolledVia = string(enrolment.ViaPodLabel) // a record written before the field: only the pod label enrolled
	}
	if dp := p.GetDeclaredPorts(); dp != nil {
		v.DeclaredPortsKnown, v.DeclaredTCPPorts = true, dp.GetTcp()
	}
	if r.Owner != nil {
		v.Owner = r.Owner.Kind + "/" + r.Owner.Name
	}
	v.LastTimings = Timings(r.LastTimings)
	if d := s.LastRemoval; d != nil {
		v.LastDel = RemovalView(*d)
	}
	return v
}

// RemovalView renders a kept DEL as the admin API returns it.
func RemovalView(r pods.Removal) *adminapi.Removal {
	return &adminapi.Removal{ContainerID: r.ContainerID, At: r.At, Timings: Timings(r.Timings)}
}

// Timings renders every set PluginTimings field (durations as
// time.Duration strings, started as RFC 3339); nil for none.
func Timings(t *cniv1.PluginTimings) map[string]string {
	if t == nil {
		return nil
	}
	out := map[string]string{}
	if t.GetStarted() != nil {
		out["started"] = t.GetStarted().AsTime().Format(time.RFC3339Nano)
	}
	add := func(k string, d *durationpb.Duration) {
		if d != nil {
			out[k] = d.AsDuration().String()
		}
	}
	add("pre_call", t.GetPreCall())
	add("readiness_probe", t.GetReadinessProbe())
	add("capture_divert", t.GetCaptureDivert())
	add("total", t.GetTotal())
	if e := t.GetReadinessProbeError(); e != "" {
		out["readiness_probe_error"] = e
	}
	if e := t.GetCaptureDivertError(); e != "" {
		out["capture_divert_error"] = e
	}
	return out
}
