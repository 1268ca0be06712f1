package workload

import (
	"fmt"

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
//     message and substrings for keys and values, instead of two allocations
//     per entry; the other fields go through proto.Unmarshal.
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
	if req, ok := v.(*discovery.DeltaDiscoveryRequest); ok {
		return decodeDeltaRequest(data.Materialize(), req)
	}
	return c.fallback.Unmarshal(data, v)
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

// decodeDeltaRequest decodes b into req, initial_resource_versions by hand.
// Keys and values are substrings of one copy of b (not validated as UTF-8:
// an invalid name matches no workload and is treated as unknown).
func decodeDeltaRequest(b []byte, req *discovery.DeltaDiscoveryRequest) error {
	var rest []byte
	var versions map[string]string
	var s string // one copy of b, made on the first map entry
	off := 0
	for off < len(b) {
		num, typ, n := protowire.ConsumeTag(b[off:])
		if n < 0 {
			return fmt.Errorf("failed to decode delta request: %w", protowire.ParseError(n))
		}
		start := off
		off += n
		if num == fieldDeltaReqInitialVersions && typ == protowire.BytesType {
			entry, m := protowire.ConsumeBytes(b[off:])
			if m < 0 {
				return fmt.Errorf("failed to decode initial_resource_versions: %w", protowire.ParseError(m))
			}
			if s == "" {
				s = string(b)
				versions = make(map[string]string, 1024)
			}
			entryOff := off + m - len(entry)
			k, v, err := mapEntry(s, entry, entryOff)
			if err != nil {
				return err
			}
			versions[k] = v
			off += m
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, b[off:])
		if m < 0 {
			return fmt.Errorf("failed to decode delta request field %d: %w", num, protowire.ParseError(m))
		}
		off += m
		rest = append(rest, b[start:off]...)
	}
	if err := proto.Unmarshal(rest, req); err != nil {
		return fmt.Errorf("failed to decode delta request: %w", err)
	}
	if versions != nil {
		req.InitialResourceVersions = versions
	}
	return nil
}

// mapEntry decodes a map<string,string> entry found at base in s.
func mapEntry(s string, entry []byte, base int) (string, string, error) {
	var k, v string
	off := 0
	for off < len(entry) {
		num, typ, n := protowire.ConsumeTag(entry[off:])
		if n < 0 {
			return "", "", fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(n))
		}
		off += n
		if typ == protowire.BytesType && (num == 1 || num == 2) {
			val, m := protowire.ConsumeBytes(entry[off:])
			if m < 0 {
				return "", "", fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(m))
			}
			from := base + off + m - len(val)
			str := s[from : from+len(val)]
			if num == 1 {
				k = str
			} else {
				v = str
			}
			off += m
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, entry[off:])
		if m < 0 {
			return "", "", fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(m))
		}
		off += m
	}
	return k, v, nil
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
