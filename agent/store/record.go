package store

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// recordVersion is the envelope version written by this code.
const recordVersion = 1

// Record is one stored pod sandbox.
type Record struct {
	// Pod is the CNIPod as the agent completed it on AddPod (identity, IPs,
	// netns, labels, annotations, uid, service account, volumes, terminating).
	Pod *cniv1.CNIPod
	// Node is the node the pod runs on.
	Node string
	// Owner is the pod's controlling owner reference, if any.
	Owner *registry.Owner
	// HostNetwork is true for host-network pods.
	HostNetwork bool
	// FixedName is true when the pod's name was not generated
	// (podsource.Pod.FixedName); false on records written before it existed,
	// which the workload builder then treats as generated (as every
	// controller-created pod is).
	FixedName bool
	// Uncaptured is true when the last ReportAddResult carried a
	// capture_divert_error: the pod runs without the mesh.
	Uncaptured bool
	// UncapturedError is that capture_divert_error.
	UncapturedError string
	// LastTimings are the plugin's timings of the last ADD, if any: those of
	// AddPod (started, pre_call), replaced by ReportAddResult's (every field).
	LastTimings *cniv1.PluginTimings
	// AddedAt is when AddPod first stored the record.
	AddedAt time.Time
	// EnrolledVia says which label made the pod mesh-managed when the
	// record was stored (pkg/enrolment.Via: "pod_label",
	// "namespace_label", "namespace_ambient"); empty on records written
	// before it existed, which only the pod label could enrol.
	EnrolledVia string
	// Locality is the node's topology when the agent last wrote the record
	// knowing it (read from its Node): what the pod's endpoint and WDS
	// workload carry while a restarted agent cannot read its Node (the API
	// server down). Zero on records written before it existed.
	Locality registry.Locality
}

// Key returns the record's key: the sandbox (container) ID.
func (r *Record) Key() string { return r.Pod.GetContainerId() }

// Clone returns a deep copy.
func (r *Record) Clone() *Record {
	if r == nil {
		return nil
	}
	c := *r
	if r.Pod != nil {
		c.Pod = cloneProto(r.Pod)
	}
	if r.LastTimings != nil {
		c.LastTimings = cloneProto(r.LastTimings)
	}
	if r.Owner != nil {
		o := *r.Owner
		c.Owner = &o
	}
	return &c
}

type envelope struct {
	Version         int             `json:"v"`
	Pod             json.RawMessage `json:"pod"`
	Node            string          `json:"node,omitempty"`
	Owner           *registry.Owner `json:"owner,omitempty"`
	HostNetwork     bool            `json:"host_network,omitempty"`
	FixedName       bool            `json:"fixed_name,omitempty"`
	Uncaptured      bool            `json:"uncaptured,omitempty"`
	UncapturedError string          `json:"uncaptured_error,omitempty"`
	LastTimings     json.RawMessage `json:"last_timings,omitempty"`
	AddedAt         time.Time       `json:"added_at"`
	EnrolledVia     string          `json:"enrolled_via,omitempty"`
	// Locality is omitted when zero; an agent that predates it ignores it.
	Locality *registry.Locality `json:"locality,omitempty"`
}

// encodeEnvelope returns r's JSON envelope: the payload of a put frame.
func encodeEnvelope(r *Record) ([]byte, error) {
	if r == nil || r.Pod == nil || r.Pod.GetContainerId() == "" {
		return nil, errors.New("failed to encode record: a record needs a pod with a container_id")
	}
	pod, err := protojson.Marshal(r.Pod)
	if err != nil {
		return nil, fmt.Errorf("failed to encode pod %q: %w", r.Pod.GetContainerId(), err)
	}
	env := envelope{
		Version: recordVersion, Pod: pod, Node: r.Node, Owner: r.Owner, HostNetwork: r.HostNetwork, FixedName: r.FixedName,
		Uncaptured: r.Uncaptured, UncapturedError: r.UncapturedError, AddedAt: r.AddedAt.UTC(), EnrolledVia: r.EnrolledVia,
	}
	if r.Locality != (registry.Locality{}) {
		l := r.Locality
		env.Locality = &l
	}
	if r.LastTimings != nil {
		if env.LastTimings, err = protojson.Marshal(r.LastTimings); err != nil {
			return nil, fmt.Errorf("failed to encode timings of %q: %w", r.Pod.GetContainerId(), err)
		}
	}
	body, err := json.Marshal(&env)
	if err != nil {
		return nil, fmt.Errorf("failed to encode record %q: %w", r.Pod.GetContainerId(), err)
	}
	return body, nil
}

// decodeEnvelope parses a JSON envelope. It fails on an unknown version or
// a pod without a container ID.
func decodeEnvelope(body []byte) (*Record, error) {
	var env envelope
	if err := json.Unmarshal(body, &env); err != nil {
		return nil, fmt.Errorf("failed to decode record envelope: %w", err)
	}
	if env.Version != recordVersion {
		return nil, fmt.Errorf("failed to decode record: version %d, this agent reads version %d", env.Version, recordVersion)
	}
	r := &Record{
		Pod: &cniv1.CNIPod{}, Node: env.Node, Owner: env.Owner, HostNetwork: env.HostNetwork, FixedName: env.FixedName,
		Uncaptured: env.Uncaptured, UncapturedError: env.UncapturedError, AddedAt: env.AddedAt, EnrolledVia: env.EnrolledVia,
	}
	if env.Locality != nil {
		r.Locality = *env.Locality
	}
	opts := protojson.UnmarshalOptions{DiscardUnknown: true}
	if err := opts.Unmarshal(env.Pod, r.Pod); err != nil {
		return nil, fmt.Errorf("failed to decode record pod: %w", err)
	}
	if r.Pod.GetContainerId() == "" {
		return nil, errors.New("failed to decode record: pod has no container_id")
	}
	if len(env.LastTimings) > 0 {
		r.LastTimings = &cniv1.PluginTimings{}
		if err := opts.Unmarshal(env.LastTimings, r.LastTimings); err != nil {
			return nil, fmt.Errorf("failed to decode record timings: %w", err)
		}
	}
	return r, nil
}

// decodeBoltValue parses a value of the bbolt store this package used
// before the log (agent.db): 4 bytes CRC-32C (big endian) of the JSON
// envelope that follows.
func decodeBoltValue(b []byte) (*Record, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("failed to decode record: %d bytes is shorter than the 4-byte checksum", len(b))
	}
	body := b[4:]
	if got, want := crc32.Checksum(body, castagnoli), binary.BigEndian.Uint32(b); got != want {
		return nil, fmt.Errorf("failed to decode record: checksum %08x does not match stored %08x", got, want)
	}
	return decodeEnvelope(body)
}
