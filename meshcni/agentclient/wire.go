package agentclient

import (
	"sort"

	"aether.io/node/meshcni/internal/pbwire"
)

// The plugin's requests and the agent's answers are encoded here by hand,
// field by field, in the protobuf wire format (meshcni/internal/pbwire),
// from and into the plain types of messages.go: the protobuf runtime's
// package init, and the reflective coder tables the first proto.Marshal of a
// message type builds, cost a plugin process that lives for one call more
// than its messages (see README.md, "Where an ADD's process time goes"). The
// encoders write what deterministic proto.Marshal writes (proto3: zero
// scalars and nil messages omitted, fields in number order, map entries
// sorted by key); the decoders read what proto.Unmarshal reads (unknown
// fields skipped, a repeated scalar keeps the last value, a repeated message
// merges). wire_test.go checks every field of every message against the
// generated code both ways, so a field added to cni.proto fails the tests
// until it is handled here.

func appendSecondsNanos(b []byte, s int64, n int32) []byte {
	b = pbwire.AppendUint(b, 1, uint64(s))
	return pbwire.AppendUint(b, 2, uint64(int64(n)))
}

func appendDuration(b []byte, num int32, d *Duration) []byte {
	if d == nil {
		return b
	}
	return pbwire.AppendMessage(b, num, func(b []byte) []byte { return appendSecondsNanos(b, d.Seconds, d.Nanos) })
}

func appendTimestamp(b []byte, num int32, t *Timestamp) []byte {
	if t == nil {
		return b
	}
	return pbwire.AppendMessage(b, num, func(b []byte) []byte { return appendSecondsNanos(b, t.Seconds, t.Nanos) })
}

func appendStringMap(b []byte, num int32, m map[string]string) []byte {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		b = pbwire.AppendMessage(b, num, func(b []byte) []byte {
			b = pbwire.AppendString(b, 1, k)
			return pbwire.AppendString(b, 2, m[k])
		})
	}
	return b
}

func appendPod(b []byte, num int32, p *Pod) []byte {
	if p == nil {
		return b
	}
	return pbwire.AppendMessage(b, num, func(b []byte) []byte {
		b = pbwire.AppendString(b, 1, p.Name)
		b = pbwire.AppendString(b, 2, p.Namespace)
		b = pbwire.AppendString(b, 3, p.NetworkNamespace)
		b = pbwire.AppendString(b, 4, p.ContainerID)
		b = pbwire.AppendRepeatedString(b, 5, p.IPs)
		b = appendStringMap(b, 6, p.Labels)
		b = appendStringMap(b, 7, p.Annotations)
		if p.PID != nil {
			b = pbwire.AppendMessage(b, 8, func(b []byte) []byte { return pbwire.AppendUint(b, 1, uint64(*p.PID)) })
		}
		b = pbwire.AppendString(b, 9, p.ServiceAccount)
		b = pbwire.AppendBool(b, 10, p.Terminating)
		b = pbwire.AppendString(b, 11, p.UID)
		b = pbwire.AppendString(b, 12, p.UDSCSIVolume)
		b = pbwire.AppendRepeatedString(b, 13, p.Volumes)
		b = pbwire.AppendUint(b, 14, uint64(p.UDSCSIVolumes))
		if p.DeclaredPorts != nil {
			b = pbwire.AppendMessage(b, 15, func(b []byte) []byte { return pbwire.AppendPackedUint32(b, 1, p.DeclaredPorts.TCP) })
		}
		return b
	})
}

func appendTimings(b []byte, num int32, t *Timings) []byte {
	if t == nil {
		return b
	}
	return pbwire.AppendMessage(b, num, func(b []byte) []byte {
		b = appendTimestamp(b, 1, t.Started)
		b = appendDuration(b, 2, t.PreCall)
		b = appendDuration(b, 3, t.ReadinessProbe)
		b = pbwire.AppendString(b, 4, t.ReadinessProbeError)
		b = appendDuration(b, 5, t.CaptureDivert)
		b = pbwire.AppendString(b, 6, t.CaptureDivertError)
		return appendDuration(b, 7, t.Total)
	})
}

// marshalAddPod encodes an AddPodRequest.
func marshalAddPod(req *AddPodRequest) []byte {
	b := make([]byte, 0, 512)
	b = appendPod(b, 1, req.Pod)
	return appendTimings(b, 2, req.PluginTimings)
}

// marshalRemovePod encodes a RemovePodRequest.
func marshalRemovePod(req *RemovePodRequest) []byte {
	b := make([]byte, 0, 256)
	b = pbwire.AppendString(b, 1, req.Name)
	b = pbwire.AppendString(b, 2, req.Namespace)
	b = pbwire.AppendString(b, 4, req.ContainerID)
	return appendTimings(b, 5, req.PluginTimings)
}

// marshalReport encodes a ReportAddResultRequest.
func marshalReport(req *ReportRequest) []byte {
	b := make([]byte, 0, 256)
	b = pbwire.AppendString(b, 1, req.ContainerID)
	b = pbwire.AppendString(b, 2, req.Name)
	b = pbwire.AppendString(b, 3, req.Namespace)
	return appendTimings(b, 4, req.Timings)
}

// marshalGetPod encodes GetPodRequest{container_id}.
func marshalGetPod(containerID string) []byte {
	return pbwire.AppendString(nil, 1, containerID)
}

// resultField decodes AddPodResponse or RemovePodResponse (both: enum result
// = 1) and returns the result.
func resultField(b []byte) (int32, error) {
	var res int32
	err := pbwire.Decode(b, func(f pbwire.Field) error {
		if f.Num == 1 {
			f.Int32(&res)
		}
		return nil
	})
	return res, err
}

// unmarshalRecord decodes a GetPodResponse.
func unmarshalRecord(b []byte) (*Record, error) {
	r := &Record{}
	err := pbwire.Decode(b, func(f pbwire.Field) error {
		switch f.Num {
		case 1:
			return f.Message(func(b []byte) error {
				if r.Pod == nil {
					r.Pod = &Pod{}
				}
				return decodePod(b, r.Pod)
			})
		case 2:
			f.Bool(&r.Managed)
		case 3:
			f.Bool(&r.Registered)
		case 4:
			f.Bool(&r.Uncaptured)
		case 5:
			return f.Message(func(b []byte) error {
				if r.LastTimings == nil {
					r.LastTimings = &Timings{}
				}
				return decodeTimings(b, r.LastTimings)
			})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// decodePod decodes a CNIPod into p (merging, as a repeated message field
// is merged).
func decodePod(b []byte, p *Pod) error {
	return pbwire.Decode(b, func(f pbwire.Field) error {
		switch f.Num {
		case 1:
			return f.String(&p.Name)
		case 2:
			return f.String(&p.Namespace)
		case 3:
			return f.String(&p.NetworkNamespace)
		case 4:
			return f.String(&p.ContainerID)
		case 5:
			return f.AppendTo(&p.IPs)
		case 6:
			return f.StringMapEntry(&p.Labels)
		case 7:
			return f.StringMapEntry(&p.Annotations)
		case 8:
			return f.Message(func(b []byte) error {
				if p.PID == nil {
					p.PID = new(uint32)
				}
				return pbwire.Decode(b, func(f pbwire.Field) error {
					if f.Num == 1 {
						f.Uint32(p.PID)
					}
					return nil
				})
			})
		case 9:
			return f.String(&p.ServiceAccount)
		case 10:
			f.Bool(&p.Terminating)
		case 11:
			return f.String(&p.UID)
		case 12:
			return f.String(&p.UDSCSIVolume)
		case 13:
			return f.AppendTo(&p.Volumes)
		case 14:
			f.Uint32(&p.UDSCSIVolumes)
		case 15:
			return f.Message(func(b []byte) error {
				if p.DeclaredPorts == nil {
					p.DeclaredPorts = &DeclaredPorts{}
				}
				return pbwire.Decode(b, func(f pbwire.Field) error {
					if f.Num == 1 {
						return f.AppendUint32s(&p.DeclaredPorts.TCP)
					}
					return nil
				})
			})
		}
		return nil
	})
}

// decodeSecondsNanos decodes a Duration or Timestamp's fields.
func decodeSecondsNanos(b []byte, s *int64, n *int32) error {
	return pbwire.Decode(b, func(f pbwire.Field) error {
		switch f.Num {
		case 1:
			f.Int64(s)
		case 2:
			f.Int32(n)
		}
		return nil
	})
}

func decodeDuration(f pbwire.Field, d **Duration) error {
	return f.Message(func(b []byte) error {
		if *d == nil {
			*d = &Duration{}
		}
		return decodeSecondsNanos(b, &(*d).Seconds, &(*d).Nanos)
	})
}

// decodeTimings decodes a PluginTimings into t (merging).
func decodeTimings(b []byte, t *Timings) error {
	return pbwire.Decode(b, func(f pbwire.Field) error {
		switch f.Num {
		case 1:
			return f.Message(func(b []byte) error {
				if t.Started == nil {
					t.Started = &Timestamp{}
				}
				return decodeSecondsNanos(b, &t.Started.Seconds, &t.Started.Nanos)
			})
		case 2:
			return decodeDuration(f, &t.PreCall)
		case 3:
			return decodeDuration(f, &t.ReadinessProbe)
		case 4:
			return f.String(&t.ReadinessProbeError)
		case 5:
			return decodeDuration(f, &t.CaptureDivert)
		case 6:
			return f.String(&t.CaptureDivertError)
		case 7:
			return decodeDuration(f, &t.Total)
		}
		return nil
	})
}
