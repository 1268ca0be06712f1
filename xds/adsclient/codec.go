package adsclient

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

// fieldInitialVersions is DeltaDiscoveryRequest.initial_resource_versions
// (map<string,string>: entries are messages {1: key, 2: value}).
const fieldInitialVersions protowire.Number = 5

// Codec returns the gRPC codec of a delta ADS client (the Client installs
// it on its own connection; other clients pass it with grpc.ForceCodecV2).
// It marshals a DeltaDiscoveryRequest's initial_resource_versions by hand:
// on a reconnect that is tens of thousands of entries (70k workloads are
// ~4 MB), which the generic proto codec encodes through reflection at
// several times the cost. Everything else, and every decode, goes through
// the standard proto codec; the wire form is the same.
func Codec() encoding.CodecV2 {
	return codec{fallback: encoding.GetCodecV2("proto")}
}

type codec struct{ fallback encoding.CodecV2 }

func (codec) Name() string { return "proto" }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *EncodedRequest:
		out := make(mem.BufferSlice, len(m.parts))
		for i, p := range m.parts {
			out[i] = mem.SliceBuffer(p)
		}
		return out, nil
	case *discovery.DeltaDiscoveryRequest:
		if len(m.GetInitialResourceVersions()) > 0 {
			return marshalDeltaRequest(m, m.GetInitialResourceVersions())
		}
	}
	return c.fallback.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.fallback.Unmarshal(data, v) }

// EncodedRequest is a DeltaDiscoveryRequest already in its wire form, in
// parts (Versions.Request). Only Codec sends it.
type EncodedRequest struct{ parts [][]byte }

// headOf returns a shallow copy of req without initial_resource_versions:
// its other fields, whatever they are.
func headOf(req *discovery.DeltaDiscoveryRequest) *discovery.DeltaDiscoveryRequest {
	head := &discovery.DeltaDiscoveryRequest{}
	dst := head.ProtoReflect()
	req.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Number() != fieldInitialVersions {
			dst.Set(fd, v)
		}
		return true
	})
	return head
}

// marshalHead appends the wire form of head (headOf) to b.
func marshalHead(head *discovery.DeltaDiscoveryRequest, b []byte) ([]byte, error) {
	b, err := proto.MarshalOptions{}.MarshalAppend(b, head)
	if err != nil {
		return nil, fmt.Errorf("failed to encode delta request for %s: %w", head.GetTypeUrl(), err)
	}
	return b, nil
}

// marshalDeltaRequest returns the wire form of req with versions as its
// initial_resource_versions: every other field through proto.Marshal
// (marshalHead), the map entries appended by hand into one buffer of the
// exact size. Keys and values are written as they are (the generic codec
// would refuse invalid UTF-8; a server matches such a name to no
// resource). The buffer comes from gRPC's default pool and goes back to
// it once sent: one request after another reuses the megabytes instead of
// faulting in fresh pages.
func marshalDeltaRequest(req *discovery.DeltaDiscoveryRequest, versions map[string]string) (mem.BufferSlice, error) {
	head := headOf(req)
	size := proto.Size(head)
	for k, v := range versions {
		size += entrySize(k, v)
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	b, err := marshalHead(head, (*buf)[:0])
	if err != nil {
		pool.Put(buf)
		return nil, err
	}
	for k, v := range versions {
		b = appendEntry(b, k, v)
	}
	*buf = b // the exact size: b never outgrew buf
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// appendEntry appends k and v as an initial_resource_versions field (a map
// entry message {1: k, 2: v}).
func appendEntry(b []byte, k, v string) []byte {
	b = protowire.AppendTag(b, fieldInitialVersions, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(entryBodySize(k, v)))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, k)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	return protowire.AppendString(b, v)
}

// entryBodySize is the size of a map entry message {1: k, 2: v}.
func entryBodySize(k, v string) int {
	return protowire.SizeTag(1) + protowire.SizeBytes(len(k)) + protowire.SizeTag(2) + protowire.SizeBytes(len(v))
}

// entrySize is the size of the entry as field 5 of the request.
func entrySize(k, v string) int {
	return protowire.SizeTag(fieldInitialVersions) + protowire.SizeBytes(entryBodySize(k, v))
}
