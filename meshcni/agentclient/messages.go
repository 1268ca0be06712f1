package agentclient

import (
	"math"
	"strconv"
	"time"
)

// The messages of aether.cni.v1 (api/aether/cni/v1/cni.proto) the plugin
// sends and reads, as plain Go types: the generated ones would link the
// protobuf runtime into every exec (see wire.go). A message field is a
// pointer (nil = unset), as in the generated code; wire_test.go maps each
// type field by field to the generated one.

// Pod is aether.cni.v1.CNIPod.
type Pod struct {
	Name             string
	Namespace        string
	NetworkNamespace string
	ContainerID      string
	IPs              []string
	Labels           map[string]string
	Annotations      map[string]string
	// PID is the google.protobuf.UInt32Value pid; nil = unset.
	PID            *uint32
	ServiceAccount string
	Terminating    bool
	UID            string
	UDSCSIVolume   string
	Volumes        []string
	UDSCSIVolumes  uint32
	// DeclaredPorts is the pod's declared container ports; nil = unset
	// (unknown).
	DeclaredPorts *DeclaredPorts
}

// DeclaredPorts is aether.cni.v1.DeclaredPorts.
type DeclaredPorts struct {
	TCP []uint32
}

// Timestamp is a google.protobuf.Timestamp.
type Timestamp struct {
	Seconds int64
	Nanos   int32
}

// NewTimestamp returns t as a Timestamp.
func NewTimestamp(t time.Time) *Timestamp {
	return &Timestamp{Seconds: t.Unix(), Nanos: int32(t.Nanosecond())}
}

// AsTime returns t as a time.Time (the zero Unix time for nil).
func (t *Timestamp) AsTime() time.Time {
	if t == nil {
		return time.Unix(0, 0)
	}
	return time.Unix(t.Seconds, int64(t.Nanos))
}

// Duration is a google.protobuf.Duration.
type Duration struct {
	Seconds int64
	Nanos   int32
}

// NewDuration returns d as a Duration.
func NewDuration(d time.Duration) *Duration {
	s := d / time.Second
	return &Duration{Seconds: int64(s), Nanos: int32(d - s*time.Second)}
}

// AsDuration returns d as a time.Duration, saturated at its range (0 for
// nil).
func (d *Duration) AsDuration() time.Duration {
	if d == nil {
		return 0
	}
	const maxSeconds = math.MaxInt64 / int64(time.Second)
	switch {
	case d.Seconds > maxSeconds:
		return math.MaxInt64
	case d.Seconds < -maxSeconds:
		return math.MinInt64
	}
	v := time.Duration(d.Seconds)*time.Second + time.Duration(d.Nanos)
	// Nanos of the seconds' sign may still step over the range.
	switch {
	case d.Seconds > 0 && d.Nanos > 0 && v < 0:
		return math.MaxInt64
	case d.Seconds < 0 && d.Nanos < 0 && v > 0:
		return math.MinInt64
	}
	return v
}

// Timings is aether.cni.v1.PluginTimings.
type Timings struct {
	Started             *Timestamp
	PreCall             *Duration
	ReadinessProbe      *Duration
	ReadinessProbeError string
	CaptureDivert       *Duration
	CaptureDivertError  string
	Total               *Duration
}

// AddPodRequest is aether.cni.v1.AddPodRequest.
type AddPodRequest struct {
	Pod           *Pod
	PluginTimings *Timings
}

// AddResult is aether.cni.v1.AddPodResponse.Result.
type AddResult int32

// The AddPod verdicts.
const (
	AddUnspecified AddResult = 0
	AddSuccess     AddResult = 1
	AddError       AddResult = 2
	AddIgnored     AddResult = 3
)

// String is the enum value's name in cni.proto, or its number.
func (r AddResult) String() string { return resultName(int32(r)) }

// RemovePodRequest is aether.cni.v1.RemovePodRequest.
type RemovePodRequest struct {
	Name          string
	Namespace     string
	ContainerID   string
	PluginTimings *Timings
}

// RemoveResult is aether.cni.v1.RemovePodResponse.Result.
type RemoveResult int32

// The RemovePod outcomes.
const (
	RemoveUnspecified RemoveResult = 0
	RemoveSuccess     RemoveResult = 1
	RemoveError       RemoveResult = 2
	RemoveIgnored     RemoveResult = 3
)

// String is the enum value's name in cni.proto, or its number.
func (r RemoveResult) String() string { return resultName(int32(r)) }

// resultName names a value of AddPodResponse.Result or
// RemovePodResponse.Result (the two enums have the same values).
func resultName(r int32) string {
	switch r {
	case 0:
		return "RESULT_UNSPECIFIED"
	case 1:
		return "RESULT_SUCCESS"
	case 2:
		return "RESULT_ERROR"
	case 3:
		return "RESULT_IGNORED"
	}
	return strconv.Itoa(int(r))
}

// ReportRequest is aether.cni.v1.ReportAddResultRequest.
type ReportRequest struct {
	ContainerID string
	Name        string
	Namespace   string
	Timings     *Timings
}

// Record is aether.cni.v1.GetPodResponse: the agent's record of a
// container.
type Record struct {
	Pod         *Pod
	Managed     bool
	Registered  bool
	Uncaptured  bool
	LastTimings *Timings
}
