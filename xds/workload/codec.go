package workload

import (
	"fmt"
	"strings"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	// Registers the default "proto" codec the fallback uses.
	_ "google.golang.org/grpc/encoding/proto"

	"aether.io/node/xds/resource"
)

// The xDS server's gRPC codec (installed by ServerGRPCOptions) does two
// things the generic proto codec cannot:
//
//   - it sends responses (wrapped as preEncoded) as the concatenation of a small marshalled head and
//     each resource's bytes, encoded once per change in the index: no
//     per-client marshalling, no copy of the workloads;
//   - it decodes a DeltaDiscoveryRequest's initial_resource_versions (tens of
//     thousands of entries on a large reconnect) with one string copy of the
//     message (straight from gRPC's buffers) and substrings for keys and
//     values, into a slice of entries the index compares in wire order (the
//     server receives a deltaRequest), instead of two allocations per entry
//     and a map grown through every power of two; the other fields go
//     through proto.Unmarshal.
//
// Without the codec (a grpc.Server built without ServerGRPCOptions) the same
// typed messages are marshalled normally: correct, only slower.

// preEncoded is a response whose wire form is already laid out: parts
// (a marshalled head, then each resource's shared bytes) concatenated are
// the encoding of Message. The server sends it with SendMsg; this codec
// writes the parts, any other codec marshals the embedded Message.
type preEncoded struct {
	proto.Message
	parts [][]byte
}

type xdsCodec struct{ fallback encoding.CodecV2 }

func newCodec() encoding.CodecV2 {
	return xdsCodec{fallback: encoding.GetCodecV2("proto")}
}

func (xdsCodec) Name() string { return "proto" }

func (c xdsCodec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(*preEncoded); ok {
		out := make(mem.BufferSlice, 0, len(e.parts))
		for _, p := range e.parts {
			if len(p) > 0 {
				out = append(out, mem.SliceBuffer(p))
			}
		}
		return out, nil
	}
	return c.fallback.Marshal(v)
}

func (c xdsCodec) Unmarshal(data mem.BufferSlice, v any) error {
	switch req := v.(type) {
	case *deltaRequest:
		entries, err := decodeDelta(oneString(data), req.DeltaDiscoveryRequest)
		req.known = entries
		return err
	case *discovery.DeltaDiscoveryRequest:
		return decodeDeltaRequest(oneString(data), req)
	}
	return c.fallback.Unmarshal(data, v)
}

// oneString copies a received message once, into the string its versions
// are cut from.
func oneString(data mem.BufferSlice) string {
	var b strings.Builder
	b.Grow(data.Len())
	for _, buf := range data {
		b.Write(buf.ReadOnlyData())
	}
	return b.String()
}

// deltaRequest is a DeltaDiscoveryRequest as the server receives it: this
// codec leaves initial_resource_versions out of the map and hands them over
// as entries (known) for Index.DeltaResponse; any other codec unmarshals the
// embedded message, map included.
type deltaRequest struct {
	*discovery.DeltaDiscoveryRequest
	known []knownEntry
}

// Field numbers of envoy.service.discovery.v3 messages used on the wire.
const (
	fieldDeltaReqInitialVersions protowire.Number = 5
	fieldRespResources           protowire.Number = 2 // DeltaDiscoveryResponse and DiscoveryResponse
	fieldResourceVersion         protowire.Number = 1
	fieldResourceResource        protowire.Number = 2
	fieldResourceName            protowire.Number = 3
	fieldAnyTypeURL              protowire.Number = 1
	fieldAnyValue                protowire.Number = 2
)

// decodeDeltaRequest decodes s into req, initial_resource_versions by
// hand (decodeDelta) into a map made at its size.
func decodeDeltaRequest(s string, req *discovery.DeltaDiscoveryRequest) error {
	entries, err := decodeDelta(s, req)
	if err != nil || entries == nil {
		return err
	}
	req.InitialResourceVersions = Known{entries: entries}.asMap()
	return nil
}

// decodeDelta decodes s into req except for initial_resource_versions,
// which it returns as entries in wire order: keys and values are
// substrings of s (not validated as UTF-8: an invalid name matches no
// workload and is treated as unknown), in a slice made at its size; the
// other fields go through proto.Unmarshal. A field of the deprecated group
// wire type (never in a DeltaDiscoveryRequest) sends the whole message
// through proto.Unmarshal, versions included.
func decodeDelta(s string, req *discovery.DeltaDiscoveryRequest) ([]knownEntry, error) {
	var rest []byte
	var entries []knownEntry
	off := 0
	for off < len(s) {
		start := off
		num, typ, n := consumeTag(s[off:])
		if n < 0 {
			return nil, fmt.Errorf("failed to decode delta request: %w", protowire.ParseError(n))
		}
		off += n
		m := consumeFieldValue(typ, s[off:])
		if m == errGroup {
			return nil, decodeDeltaRequestSlow(s, req)
		}
		if m < 0 {
			return nil, fmt.Errorf("failed to decode delta request field %d: %w", num, protowire.ParseError(m))
		}
		if num == fieldDeltaReqInitialVersions && typ == protowire.BytesType {
			l, ln := consumeVarint(s[off:])
			if entries == nil {
				entries = make([]knownEntry, 0, countVersions(s[start:]))
			}
			k, v, err := mapEntry(s[off+ln : off+ln+int(l)])
			if err != nil {
				return nil, err
			}
			entries = append(entries, knownEntry{name: k, version: v})
			off += m
			continue
		}
		off += m
		rest = append(rest, s[start:off]...)
	}
	if err := proto.Unmarshal(rest, req); err != nil {
		return nil, fmt.Errorf("failed to decode delta request: %w", err)
	}
	return entries, nil
}

func decodeDeltaRequestSlow(s string, req *discovery.DeltaDiscoveryRequest) error {
	if err := proto.Unmarshal([]byte(s), req); err != nil {
		return fmt.Errorf("failed to decode delta request: %w", err)
	}
	return nil
}

// countVersions counts the initial_resource_versions entries of s (a
// request's fields, from the first such entry on), so the map is made at
// its size once instead of growing through every power of two. A malformed
// field ends the count; decoding reports it.
func countVersions(s string) int {
	n := 0
	for len(s) > 0 {
		num, typ, m := consumeTag(s)
		if m < 0 {
			break
		}
		s = s[m:]
		if m = consumeFieldValue(typ, s); m < 0 {
			break
		}
		s = s[m:]
		if num == fieldDeltaReqInitialVersions {
			n++
		}
	}
	return n
}

// mapEntry decodes a map<string,string> entry.
func mapEntry(entry string) (string, string, error) {
	var k, v string
	off := 0
	for off < len(entry) {
		num, typ, n := consumeTag(entry[off:])
		if n < 0 {
			return "", "", fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(n))
		}
		off += n
		m := consumeFieldValue(typ, entry[off:])
		if m < 0 {
			return "", "", fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(m))
		}
		if typ == protowire.BytesType && (num == 1 || num == 2) {
			l, ln := consumeVarint(entry[off:])
			if num == 1 {
				k = entry[off+ln : off+ln+int(l)]
			} else {
				v = entry[off+ln : off+ln+int(l)]
			}
		}
		off += m
	}
	return k, v, nil
}

// errGroup is consumeFieldValue's answer for the group wire types, which
// the string decoder leaves to proto.Unmarshal.
const errGroup = -100

// consumeVarint is protowire.ConsumeVarint on a string.
func consumeVarint(s string) (uint64, int) {
	var v uint64
	for i := 0; i < len(s) && i < 10; i++ {
		c := s[i]
		if i == 9 && c > 1 {
			return 0, -3 // protowire's errCodeOverflow
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	if len(s) < 10 {
		return 0, -1 // protowire's errCodeTruncated
	}
	return 0, -3
}

// consumeTag is protowire.ConsumeTag on a string.
func consumeTag(s string) (protowire.Number, protowire.Type, int) {
	v, n := consumeVarint(s)
	if n < 0 {
		return 0, 0, n
	}
	num, typ := protowire.DecodeTag(v)
	if num < protowire.MinValidNumber {
		return 0, 0, -5 // protowire's errCodeFieldNumber
	}
	return num, typ, n
}

// consumeFieldValue is the length of the value of a field of wire type
// typ at the start of s (protowire.ConsumeFieldValue on a string), or a
// negative protowire error code; errGroup for the group types.
func consumeFieldValue(typ protowire.Type, s string) int {
	switch typ {
	case protowire.VarintType:
		_, n := consumeVarint(s)
		return n
	case protowire.Fixed32Type:
		if len(s) < 4 {
			return -1
		}
		return 4
	case protowire.Fixed64Type:
		if len(s) < 8 {
			return -1
		}
		return 8
	case protowire.BytesType:
		l, n := consumeVarint(s)
		if n < 0 {
			return n
		}
		if l > uint64(len(s)-n) {
			return -1
		}
		return n + int(l)
	case protowire.StartGroupType, protowire.EndGroupType:
		return errGroup
	}
	return -4 // protowire's errCodeReserved
}

// encodeResource lays out one resource's wire bytes once:
//
//	[2: DeltaDiscoveryResponse.resources] len Resource{
//	    [1] version, [2] Any{[1] type_url, [2] body}, [3] name }
//
// and returns the whole (a delta response field), the Any field (a SotW
// DiscoveryResponse.resources field: same number, 2) and the body, all
// sharing one allocation.
func encodeResource(name, version string, body []byte) (delta, sotw, value []byte) {
	anyLen := protowire.SizeTag(fieldAnyTypeURL) + protowire.SizeBytes(len(resource.WorkloadType)) +
		protowire.SizeTag(fieldAnyValue) + protowire.SizeBytes(len(body))
	resLen := protowire.SizeTag(fieldResourceVersion) + protowire.SizeBytes(len(version)) +
		protowire.SizeTag(fieldResourceResource) + protowire.SizeBytes(anyLen) +
		protowire.SizeTag(fieldResourceName) + protowire.SizeBytes(len(name))
	b := make([]byte, 0, protowire.SizeTag(fieldRespResources)+protowire.SizeBytes(resLen))
	b = protowire.AppendTag(b, fieldRespResources, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(resLen))
	b = protowire.AppendTag(b, fieldResourceVersion, protowire.BytesType)
	b = protowire.AppendString(b, version)
	sotwStart := len(b)
	b = protowire.AppendTag(b, fieldResourceResource, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anyLen))
	b = protowire.AppendTag(b, fieldAnyTypeURL, protowire.BytesType)
	b = protowire.AppendString(b, resource.WorkloadType)
	b = protowire.AppendTag(b, fieldAnyValue, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(len(body)))
	valueStart := len(b)
	b = append(b, body...)
	sotwEnd := len(b)
	b = protowire.AppendTag(b, fieldResourceName, protowire.BytesType)
	b = protowire.AppendString(b, name)
	return b, b[sotwStart:sotwEnd:sotwEnd], b[valueStart:sotwEnd:sotwEnd]
}
