package agentclient

import (
	"bytes"
	"fmt"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	cniv1 "aether.io/node/api/aether/cni/v1"
)

// fill sets every field of m (recursively) to a non-zero value derived from
// seed, two elements per list and map, so a field the hand encoders miss
// shows up as a difference. Negative numbers exercise sign extension.
func fill(t *testing.T, m protoreflect.Message, seed int) {
	t.Helper()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		n := seed*100 + int(fd.Number())
		switch {
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			for j := range 2 {
				mp.Set(scalar(t, fd.MapKey(), n*10+j).MapKey(), scalar(t, fd.MapValue(), n*10+j+5))
			}
		case fd.IsList():
			l := m.Mutable(fd).List()
			for j := range 2 {
				l.Append(scalar(t, fd, n*10+j))
			}
		case fd.Message() != nil:
			fill(t, m.Mutable(fd).Message(), n)
		default:
			m.Set(fd, scalar(t, fd, n))
		}
	}
}

func scalar(t *testing.T, fd protoreflect.FieldDescriptor, n int) protoreflect.Value {
	t.Helper()
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(fmt.Sprintf("%s-%d", fd.Name(), n))
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.Uint32Kind:
		return protoreflect.ValueOfUint32(uint32(n) + 1<<31)
	case protoreflect.Int32Kind:
		return protoreflect.ValueOfInt32(-int32(n))
	case protoreflect.Int64Kind:
		return protoreflect.ValueOfInt64(-int64(n) << 33)
	case protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(protoreflect.EnumNumber(n))
	}
	t.Fatalf("field %s: kind %s has no test value; teach fill and the encoders about it", fd.FullName(), fd.Kind())
	return protoreflect.Value{}
}

// TestMarshalMatchesProto: every field of every request the plugin encodes by
// hand comes out as proto.Marshal (deterministic) writes it, whole messages
// and with each field alone; a message field set but empty is kept.
func TestMarshalMatchesProto(t *testing.T) {
	cases := []struct {
		msg proto.Message
		enc func(proto.Message) []byte
	}{
		{&cniv1.AddPodRequest{}, func(m proto.Message) []byte { return marshalAddPod(m.(*cniv1.AddPodRequest)) }},
		{&cniv1.RemovePodRequest{}, func(m proto.Message) []byte { return marshalRemovePod(m.(*cniv1.RemovePodRequest)) }},
		{&cniv1.ReportAddResultRequest{}, func(m proto.Message) []byte { return marshalReport(m.(*cniv1.ReportAddResultRequest)) }},
	}
	det := proto.MarshalOptions{Deterministic: true}
	for _, c := range cases {
		name := string(c.msg.ProtoReflect().Descriptor().Name())
		check := func(t *testing.T, m proto.Message) {
			t.Helper()
			want, err := det.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			if got := c.enc(m); !bytes.Equal(got, want) {
				t.Fatalf("hand encoding differs from proto.Marshal\n got %x\nwant %x", got, want)
			}
		}
		t.Run(name+"/empty", func(t *testing.T) { check(t, c.msg) })
		full := proto.Clone(c.msg)
		fill(t, full.ProtoReflect(), 1)
		t.Run(name+"/full", func(t *testing.T) { check(t, full) })
		// Each field alone, and each message field present but empty.
		var walk func(path string, m protoreflect.Message)
		walk = func(path string, m protoreflect.Message) {
			m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
				p := path + "." + string(fd.Name())
				one := proto.Clone(full)
				keepOnly(one.ProtoReflect(), full.ProtoReflect(), p[len(name)+1:])
				t.Run(p, func(t *testing.T) { check(t, one) })
				if fd.Message() != nil && !fd.IsList() && !fd.IsMap() {
					empty := proto.Clone(c.msg)
					setEmpty(empty.ProtoReflect(), p[len(name)+1:])
					t.Run(p+"/empty", func(t *testing.T) { check(t, empty) })
					walk(p, v.Message())
				}
				return true
			})
		}
		walk(name, full.ProtoReflect())
	}
}

// keepOnly clears every field of dst but the dotted path (and its parents).
func keepOnly(dst, src protoreflect.Message, path string) {
	head, rest := path, ""
	for i := range len(path) {
		if path[i] == '.' {
			head, rest = path[:i], path[i+1:]
			break
		}
	}
	fds := dst.Descriptor().Fields()
	for i := range fds.Len() {
		fd := fds.Get(i)
		if string(fd.Name()) != head {
			dst.Clear(fd)
			continue
		}
		if rest != "" {
			keepOnly(dst.Mutable(fd).Message(), src.Get(fd).Message(), rest)
		}
	}
}

// setEmpty sets the message field at the dotted path, creating its parents,
// to an empty message.
func setEmpty(m protoreflect.Message, path string) {
	for {
		head, rest := path, ""
		for i := range len(path) {
			if path[i] == '.' {
				head, rest = path[:i], path[i+1:]
				break
			}
		}
		fd := m.Descriptor().Fields().ByName(protoreflect.Name(head))
		m = m.Mutable(fd).Message()
		if rest == "" {
			return
		}
		path = rest
	}
}

// TestResultField decodes AddPodResponse and RemovePodResponse as
// proto.Unmarshal does: unknown fields skipped, the last value wins, and a
// truncated message is an error.
func TestResultField(t *testing.T) {
	for _, r := range []int32{0, 1, 2, 3, 7} {
		add, _ := proto.Marshal(&cniv1.AddPodResponse{Result: cniv1.AddPodResponse_Result(r)})
		rm, _ := proto.Marshal(&cniv1.RemovePodResponse{Result: cniv1.RemovePodResponse_Result(r)})
		for _, b := range [][]byte{add, rm} {
			// An unknown field before and after (a newer agent's answer).
			b = protowire.AppendVarint(protowire.AppendTag(b, 9, protowire.VarintType), 5)
			b = append(protowire.AppendString(protowire.AppendTag(nil, 8, protowire.BytesType), "x"), b...)
			got, err := resultField(b)
			if err != nil || got != r {
				t.Fatalf("resultField(%x) = %d, %v; want %d", b, got, err, r)
			}
		}
	}
	twice := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 2)
	twice = protowire.AppendVarint(protowire.AppendTag(twice, 1, protowire.VarintType), 3)
	if got, err := resultField(twice); err != nil || got != 3 {
		t.Fatalf("repeated result: got %d, %v; want 3", got, err)
	}
	for _, bad := range [][]byte{{0x08}, {0x12, 0x05, 'a'}, {0x80}} {
		if _, err := resultField(bad); err == nil {
			t.Fatalf("resultField(%x): no error", bad)
		}
		if err := proto.Unmarshal(bad, &cniv1.AddPodResponse{}); err == nil {
			t.Fatalf("proto.Unmarshal(%x) accepts it too: not a malformed case", bad)
		}
	}
}
