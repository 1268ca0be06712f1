package agentclient

import (
	"errors"
	"sort"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	cniv1 "aether.io/node/api/aether/cni/v1"
)

// The plugin's ADD and DEL requests and their answers are encoded here by
// hand, field by field, in the protobuf wire format instead of through
// proto.Marshal/Unmarshal: the first reflective (un)marshal of a message type
// in a process builds that type's coder tables, which a plugin process that
// lives for one call pays every time (~5% of its CPU, see README.md). The
// encoders write what proto.Marshal writes (proto3: zero scalars and nil
// messages omitted, fields in number order; map entries sorted by key, as
// deterministic marshalling does); wire_test.go checks every field of every
// message against the generated code, so a field added to cni.proto fails
// the test until it is encoded here.

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	return protowire.AppendString(b, s)
}

func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.VarintType)
	return protowire.AppendVarint(b, v)
}

// appendMessage appends field num holding the message that body appends;
// nothing when present is false.
func appendMessage(b []byte, num protowire.Number, present bool, body func([]byte) []byte) []byte {
	if !present {
		return b
	}
	b = protowire.AppendTag(b, num, protowire.BytesType)
	at := len(b)
	b = body(b)
	n := len(b) - at
	// Move the body right by the length prefix's size and write the prefix.
	size := protowire.SizeVarint(uint64(n))
	b = append(b, make([]byte, size)...)
	copy(b[at+size:], b[at:at+n])
	protowire.AppendVarint(b[at:at], uint64(n))
	return b
}

func appendSecondsNanos(b []byte, s int64, n int32) []byte {
	b = appendVarint(b, 1, uint64(s))
	return appendVarint(b, 2, uint64(int64(n)))
}

func appendDuration(b []byte, num protowire.Number, d *durationpb.Duration) []byte {
	return appendMessage(b, num, d != nil, func(b []byte) []byte {
		return appendSecondsNanos(b, d.GetSeconds(), d.GetNanos())
	})
}

func appendTimestamp(b []byte, num protowire.Number, t *timestamppb.Timestamp) []byte {
	return appendMessage(b, num, t != nil, func(b []byte) []byte {
		return appendSecondsNanos(b, t.GetSeconds(), t.GetNanos())
	})
}

func appendStringMap(b []byte, num protowire.Number, m map[string]string) []byte {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		b = appendMessage(b, num, true, func(b []byte) []byte {
			b = appendString(b, 1, k)
			return appendString(b, 2, m[k])
		})
	}
	return b
}

func appendRepeatedString(b []byte, num protowire.Number, ss []string) []byte {
	for _, s := range ss {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		b = protowire.AppendString(b, s)
	}
	return b
}

func appendBool(b []byte, num protowire.Number, v bool) []byte {
	if !v {
		return b
	}
	return appendVarint(b, num, 1)
}

func appendPod(b []byte, p *cniv1.CNIPod) []byte {
	b = appendString(b, 1, p.GetName())
	b = appendString(b, 2, p.GetNamespace())
	b = appendString(b, 3, p.GetNetworkNamespace())
	b = appendString(b, 4, p.GetContainerId())
	b = appendRepeatedString(b, 5, p.GetIps())
	b = appendStringMap(b, 6, p.GetLabels())
	b = appendStringMap(b, 7, p.GetAnnotations())
	b = appendMessage(b, 8, p.GetPid() != nil, func(b []byte) []byte {
		return appendVarint(b, 1, uint64(p.GetPid().GetValue()))
	})
	b = appendString(b, 9, p.GetServiceAccount())
	b = appendBool(b, 10, p.GetTerminating())
	b = appendString(b, 11, p.GetUid())
	b = appendString(b, 12, p.GetUdsCsiVolume())
	b = appendRepeatedString(b, 13, p.GetVolumes())
	return appendVarint(b, 14, uint64(p.GetUdsCsiVolumes()))
}

func appendTimings(b []byte, num protowire.Number, t *cniv1.PluginTimings) []byte {
	return appendMessage(b, num, t != nil, func(b []byte) []byte {
		b = appendTimestamp(b, 1, t.GetStarted())
		b = appendDuration(b, 2, t.GetPreCall())
		b = appendDuration(b, 3, t.GetReadinessProbe())
		b = appendString(b, 4, t.GetReadinessProbeError())
		b = appendDuration(b, 5, t.GetCaptureDivert())
		b = appendString(b, 6, t.GetCaptureDivertError())
		return appendDuration(b, 7, t.GetTotal())
	})
}

// marshalAddPod encodes req as proto.Marshal would.
func marshalAddPod(req *cniv1.AddPodRequest) []byte {
	b := make([]byte, 0, 512)
	b = appendMessage(b, 1, req.GetPod() != nil, func(b []byte) []byte { return appendPod(b, req.GetPod()) })
	return appendTimings(b, 2, req.GetPluginTimings())
}

// marshalRemovePod encodes req as proto.Marshal would.
func marshalRemovePod(req *cniv1.RemovePodRequest) []byte {
	b := make([]byte, 0, 256)
	b = appendString(b, 1, req.GetName())
	b = appendString(b, 2, req.GetNamespace())
	b = appendString(b, 4, req.GetContainerId())
	return appendTimings(b, 5, req.GetPluginTimings())
}

// marshalReport encodes req as proto.Marshal would.
func marshalReport(req *cniv1.ReportAddResultRequest) []byte {
	b := make([]byte, 0, 256)
	b = appendString(b, 1, req.GetContainerId())
	b = appendString(b, 2, req.GetName())
	b = appendString(b, 3, req.GetNamespace())
	return appendTimings(b, 4, req.GetTimings())
}

var errBadResponse = errors.New("malformed response message")

// resultField decodes AddPodResponse or RemovePodResponse (both: enum result
// = 1) and returns the result; unknown fields are skipped, as
// proto.Unmarshal does, and a repeated field keeps the last value.
func resultField(b []byte) (int32, error) {
	var res int32
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, errBadResponse
		}
		b = b[n:]
		if num == 1 && typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return 0, errBadResponse
			}
			res = int32(v)
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return 0, errBadResponse
		}
		b = b[n:]
	}
	return res, nil
}
