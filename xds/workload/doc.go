// Package workload is workload discovery (WDS): it serves every mesh pod as
// an istio.workload.Workload xDS resource (resource.WorkloadType) over ADS,
// Delta and SotW.
//
// Builder (Build, Validate, UID) turns registry endpoints into Workloads;
// a Follower keeps an Index in step with a registry.Registry; the Index
// marshals each workload once, versions it by content hash and selects what
// each stream must be sent (it implements Cache, the seam to the Server);
// the Server only speaks the protocol and sends the shared, pre-encoded
// bytes through its gRPC codec. See README.md for the protocol behaviour and
// invariants.
package workload
