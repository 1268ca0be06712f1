package workload

import (
	"fmt"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	// Registers the default "proto" codec the fallback uses.
	_ "google.golang.org/grpc/encoding/proto"
)

// The xDS server's gRPC codec (installed by ServerGRPCOptions) does two
// things the generic proto codec cannot:
//
//   - it sends responses (wrapped as preEncoded) as the concatenation of a small marshalled head and
//     each resource's bytes, encoded once per change in the index: no
//     per-client marshalling, no copy of the workloads;
//   - it decodes a DeltaDiscoveryRequest's initial_resource_versions (tens
//     of thousands of entries on a large reconnect) without a map or a
//     string per entry: the message is gathered into one pooled buffer,
//     the entries are validated and counted, and the index compares them
//     in wire order straight from that buffer (the server receives a
//     deltaRequest and releases it after its response); the other fields
//     go through proto.Unmarshal.
//
// Without the codec (a grpc.Server built without ServerGRPCOptions) the same
// typed messages are marshalled normally: correct, only slower.

// preEncoded is a response whose wire form is already laid out: parts
// (a marshalled head, then each resource's shared bytes) concatenated are
// the encoding of Message. The server sends it with SendMsg; this codec
// writes the parts, any other codec marshals the embedded Message, which
// build makes on first use when it is nil (so a server with this codec
// never builds the typed response nor keeps an Any per resource).
type preEncoded struct {
	proto.Message
	build func() proto.Message
	parts [][]byte
}

// ProtoReflect is the embedded Message's, built first if need be.
func (e *preEncoded) ProtoReflect() protoreflect.Message {
	if e.Message == nil {
		e.Message = e.build()
	}
	return e.Message.ProtoReflect()
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
		return req.decode(data)
	case *discovery.DeltaDiscoveryRequest:
		return decodeDeltaRequest(data.Materialize(), req)
	}
	return c.fallback.Unmarshal(data, v)
}

// deltaRequest is a DeltaDiscoveryRequest as the server receives it: this
// codec leaves initial_resource_versions out of the map and hands them over
// in wire form (known) for Index.DeltaResponse; any other codec unmarshals
// the embedded message, map included. Call release once known is no longer
// used.
type deltaRequest struct {
	*discovery.DeltaDiscoveryRequest
	known Known
	buf   mem.Buffer // holds known's wire; nil when there is none
}

// decode decodes data into r. The message is gathered into one buffer of
// gRPC's default pool (a reconnect reuses the megabytes of the previous one
// instead of faulting in fresh pages), which known then points into until
// release.
func (r *deltaRequest) decode(data mem.BufferSlice) error {
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	known, err := decodeDelta(buf.ReadOnlyData(), r.DeltaDiscoveryRequest)
	if err != nil || known.n == 0 {
		buf.Free()
		return err
	}
	r.known, r.buf = known, buf
	return nil
}

// versions returns the versions the request carries, from whichever codec
// decoded it.
func (r *deltaRequest) versions() Known {
	if r.known.n == 0 && len(r.GetInitialResourceVersions()) > 0 {
		return KnownMap(r.GetInitialResourceVersions())
	}
	return r.known
}

// release returns the buffer known points into to the pool.
func (r *deltaRequest) release() {
	if r.buf != nil {
		r.buf.Free()
		r.buf, r.known = nil, Known{}
	}
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

// decodeDeltaRequest decodes b into req, initial_resource_versions by
// hand (decodeDelta) into a map made at its size.
func decodeDeltaRequest(b []byte, req *discovery.DeltaDiscoveryRequest) error {
	known, err := decodeDelta(b, req)
	if err != nil || known.n == 0 {
		return err
	}
	req.InitialResourceVersions = known.asMap()
	return nil
}

// decodeDelta decodes b into req except for initial_resource_versions,
// which it validates, counts and returns in wire form, pointing into b
// (keys and values are not validated as UTF-8: an invalid name matches no
// workload and is treated as unknown); the other fields go through
// proto.Unmarshal.
func decodeDelta(b []byte, req *discovery.DeltaDiscoveryRequest) (Known, error) {
	var rest []byte
	n := 0
	for off := 0; off < len(b); {
		entry, isEntry, l := nextField(b[off:])
		if l < 0 {
			return Known{}, fmt.Errorf("failed to decode delta request: %w", protowire.ParseError(l))
		}
		if isEntry {
			if _, _, err := mapEntry(entry); err != nil {
				return Known{}, err
			}
			n++
		} else {
			rest = append(rest, b[off:off+l]...)
		}
		off += l
	}
	if err := proto.Unmarshal(rest, req); err != nil {
		return Known{}, fmt.Errorf("failed to decode delta request: %w", err)
	}
	if n == 0 {
		return Known{}, nil
	}
	return Known{wire: b, n: n}, nil
}

// Tag bytes of the fields a reconnect repeats tens of thousands of times:
// an initial_resource_versions field and its entry's key and value.
const (
	tagVersionsEntry = byte(fieldDeltaReqInitialVersions<<3) | byte(protowire.BytesType)
	tagEntryKey      = byte(1<<3) | byte(protowire.BytesType)
	tagEntryValue    = byte(2<<3) | byte(protowire.BytesType)
)

// nextField returns the length n of the field at the start of a
// request's wire form b (negative: a protowire error code) and, if it is
// an initial_resource_versions field, its entry. Entries under 128 bytes
// (any uid under ~100 characters) take a fast path.
func nextField(b []byte) (entry []byte, isEntry bool, n int) {
	if len(b) >= 2 && b[0] == tagVersionsEntry && b[1] < 0x80 {
		l := int(b[1])
		if l > len(b)-2 {
			return nil, false, -1 // protowire's errCodeTruncated
		}
		return b[2 : 2+l], true, 2 + l
	}
	num, typ, t := protowire.ConsumeTag(b)
	if t < 0 {
		return nil, false, t
	}
	m := protowire.ConsumeFieldValue(num, typ, b[t:])
	if m < 0 {
		return nil, false, m
	}
	if num == fieldDeltaReqInitialVersions && typ == protowire.BytesType {
		entry, _ = protowire.ConsumeBytes(b[t:])
		return entry, true, t + m
	}
	return nil, false, t + m
}

// mapEntry decodes a map<string,string> entry. The layout every encoder
// writes ({1: k, 2: v}, each under 128 bytes) takes a fast path.
func mapEntry(entry []byte) (k, v []byte, err error) {
	if len(entry) >= 4 && entry[0] == tagEntryKey && entry[1] < 0x80 {
		kl := int(entry[1])
		if r := entry[2:]; kl+2 <= len(r) && r[kl] == tagEntryValue && r[kl+1] < 0x80 && kl+2+int(r[kl+1]) == len(r) {
			return r[:kl], r[kl+2:], nil
		}
	}
	for len(entry) > 0 {
		num, typ, n := protowire.ConsumeTag(entry)
		if n < 0 {
			return nil, nil, fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(n))
		}
		entry = entry[n:]
		m := protowire.ConsumeFieldValue(num, typ, entry)
		if m < 0 {
			return nil, nil, fmt.Errorf("failed to decode initial_resource_versions entry: %w", protowire.ParseError(m))
		}
		if typ == protowire.BytesType && (num == 1 || num == 2) {
			b, _ := protowire.ConsumeBytes(entry)
			if num == 1 {
				k = b
			} else {
				v = b
			}
		}
		entry = entry[m:]
	}
	return k, v, nil
}

// encodeFrame lays out, once, the bytes around a resource's value:
//
//	pre: [2: DeltaDiscoveryResponse.resources] len Resource{
//	         [1] version, [2] Any{[1] type_url, [2] len
//	value (not copied: a workload's bytes are shared by its Workload and
//	       Address resources)
//	suf:     [3] name }
//
// pre[sotwAt:] followed by the value is the Any field of a SotW
// DiscoveryResponse.resources (same field number, 2). It returns pre and
// suf as one slice b (pre is b[:preLen]).
func encodeFrame(typeURL, name, version string, valueLen int) (b []byte, preLen, sotwAt int) {
	anyLen := protowire.SizeTag(fieldAnyTypeURL) + protowire.SizeBytes(len(typeURL)) +
		protowire.SizeTag(fieldAnyValue) + protowire.SizeBytes(valueLen)
	resLen := protowire.SizeTag(fieldResourceVersion) + protowire.SizeBytes(len(version)) +
		protowire.SizeTag(fieldResourceResource) + protowire.SizeBytes(anyLen) +
		protowire.SizeTag(fieldResourceName) + protowire.SizeBytes(len(name))
	b = make([]byte, 0, protowire.SizeTag(fieldRespResources)+protowire.SizeBytes(resLen)-valueLen)
	b = protowire.AppendTag(b, fieldRespResources, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(resLen))
	b = protowire.AppendTag(b, fieldResourceVersion, protowire.BytesType)
	b = protowire.AppendString(b, version)
	sotwAt = len(b)
	b = protowire.AppendTag(b, fieldResourceResource, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(anyLen))
	b = protowire.AppendTag(b, fieldAnyTypeURL, protowire.BytesType)
	b = protowire.AppendString(b, typeURL)
	b = protowire.AppendTag(b, fieldAnyValue, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(valueLen))
	preLen = len(b)
	b = protowire.AppendTag(b, fieldResourceName, protowire.BytesType)
	b = protowire.AppendString(b, name)
	return b, preLen, sotwAt
}
