package agentclient

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/meshcni/internal/pbwire"
)

// fill sets every field of m (recursively) to a non-zero value derived from
// seed, two elements per list and map, so a field the hand encoders miss
// shows up as a difference. Negative numbers exercise sign extension.
func fill(t testing.TB, m protoreflect.Message, seed int) {
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

func scalar(t testing.TB, fd protoreflect.FieldDescriptor, n int) protoreflect.Value {
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

// The plain types and the generated ones, field by field: a field added to
// cni.proto is filled by fill but mapped by none of these, so the tests
// below fail until messages.go and wire.go carry it.

func durationOf(d *durationpb.Duration) *Duration {
	if d == nil {
		return nil
	}
	return &Duration{Seconds: d.GetSeconds(), Nanos: d.GetNanos()}
}

func durationpbOf(d *Duration) *durationpb.Duration {
	if d == nil {
		return nil
	}
	return &durationpb.Duration{Seconds: d.Seconds, Nanos: d.Nanos}
}

func timingsOf(t *cniv1.PluginTimings) *Timings {
	if t == nil {
		return nil
	}
	out := &Timings{
		PreCall: durationOf(t.GetPreCall()), ReadinessProbe: durationOf(t.GetReadinessProbe()), ReadinessProbeError: t.GetReadinessProbeError(),
		CaptureDivert: durationOf(t.GetCaptureDivert()), CaptureDivertError: t.GetCaptureDivertError(), Total: durationOf(t.GetTotal()),
	}
	if s := t.GetStarted(); s != nil {
		out.Started = &Timestamp{Seconds: s.GetSeconds(), Nanos: s.GetNanos()}
	}
	return out
}

func timingsPB(t *Timings) *cniv1.PluginTimings {
	if t == nil {
		return nil
	}
	out := &cniv1.PluginTimings{
		PreCall: durationpbOf(t.PreCall), ReadinessProbe: durationpbOf(t.ReadinessProbe), ReadinessProbeError: t.ReadinessProbeError,
		CaptureDivert: durationpbOf(t.CaptureDivert), CaptureDivertError: t.CaptureDivertError, Total: durationpbOf(t.Total),
	}
	if t.Started != nil {
		out.Started = &timestamppb.Timestamp{Seconds: t.Started.Seconds, Nanos: t.Started.Nanos}
	}
	return out
}

func podOf(p *cniv1.CNIPod) *Pod {
	if p == nil {
		return nil
	}
	out := &Pod{
		Name: p.GetName(), Namespace: p.GetNamespace(), NetworkNamespace: p.GetNetworkNamespace(), ContainerID: p.GetContainerId(),
		IPs: p.GetIps(), Labels: p.GetLabels(), Annotations: p.GetAnnotations(), ServiceAccount: p.GetServiceAccount(),
		Terminating: p.GetTerminating(), UID: p.GetUid(), UDSCSIVolume: p.GetUdsCsiVolume(), Volumes: p.GetVolumes(),
		UDSCSIVolumes: p.GetUdsCsiVolumes(),
	}
	if dp := p.GetDeclaredPorts(); dp != nil {
		out.DeclaredPorts = &DeclaredPorts{TCP: dp.GetTcp()}
	}
	if p.GetPid() != nil {
		v := p.GetPid().GetValue()
		out.PID = &v
	}
	return out
}

func podPB(p *Pod) *cniv1.CNIPod {
	if p == nil {
		return nil
	}
	out := &cniv1.CNIPod{
		Name: p.Name, Namespace: p.Namespace, NetworkNamespace: p.NetworkNamespace, ContainerId: p.ContainerID,
		Ips: p.IPs, Labels: p.Labels, Annotations: p.Annotations, ServiceAccount: p.ServiceAccount,
		Terminating: p.Terminating, Uid: p.UID, UdsCsiVolume: p.UDSCSIVolume, Volumes: p.Volumes,
		UdsCsiVolumes: p.UDSCSIVolumes,
	}
	if p.DeclaredPorts != nil {
		out.DeclaredPorts = &cniv1.DeclaredPorts{Tcp: p.DeclaredPorts.TCP}
	}
	if p.PID != nil {
		out.Pid = wrapperspb.UInt32(*p.PID)
	}
	return out
}

func recordPB(r *Record) *cniv1.GetPodResponse {
	return &cniv1.GetPodResponse{
		Pod: podPB(r.Pod), Managed: r.Managed, Registered: r.Registered, Uncaptured: r.Uncaptured,
		LastTimings: timingsPB(r.LastTimings),
	}
}

// TestMarshalMatchesProto: every field of every request the plugin encodes by
// hand comes out as proto.Marshal (deterministic) writes it, whole messages
// and with each field alone; a message field set but empty is kept.
func TestMarshalMatchesProto(t *testing.T) {
	cases := []struct {
		msg proto.Message
		enc func(proto.Message) []byte
	}{
		{&cniv1.AddPodRequest{}, func(m proto.Message) []byte {
			r := m.(*cniv1.AddPodRequest)
			return marshalAddPod(&AddPodRequest{Pod: podOf(r.GetPod()), PluginTimings: timingsOf(r.GetPluginTimings())})
		}},
		{&cniv1.RemovePodRequest{}, func(m proto.Message) []byte {
			r := m.(*cniv1.RemovePodRequest)
			return marshalRemovePod(&RemovePodRequest{Name: r.GetName(), Namespace: r.GetNamespace(), ContainerID: r.GetContainerId(), PluginTimings: timingsOf(r.GetPluginTimings())})
		}},
		{&cniv1.ReportAddResultRequest{}, func(m proto.Message) []byte {
			r := m.(*cniv1.ReportAddResultRequest)
			return marshalReport(&ReportRequest{ContainerID: r.GetContainerId(), Name: r.GetName(), Namespace: r.GetNamespace(), Timings: timingsOf(r.GetTimings())})
		}},
		{&cniv1.GetPodRequest{}, func(m proto.Message) []byte { return marshalGetPod(m.(*cniv1.GetPodRequest).GetContainerId()) }},
	}
	det := proto.MarshalOptions{Deterministic: true}
	for _, c := range cases {
		for name, m := range variants(t, c.msg) {
			t.Run(name, func(t *testing.T) {
				want, err := det.Marshal(m)
				if err != nil {
					t.Fatal(err)
				}
				if got := c.enc(m); !bytes.Equal(got, want) {
					t.Fatalf("hand encoding differs from proto.Marshal\n got %x\nwant %x", got, want)
				}
			})
		}
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

// variants are msg with every field set (fill), and each field alone, down
// through the message fields, each of those also present but empty.
func variants(t testing.TB, msg proto.Message) map[string]proto.Message {
	t.Helper()
	name := string(msg.ProtoReflect().Descriptor().Name())
	full := proto.Clone(msg)
	fill(t, full.ProtoReflect(), 1)
	out := map[string]proto.Message{name + "/empty": msg, name + "/full": full}
	var walk func(path string, m protoreflect.Message)
	walk = func(path string, m protoreflect.Message) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			p := path + "." + string(fd.Name())
			one := proto.Clone(full)
			keepOnly(one.ProtoReflect(), full.ProtoReflect(), p[len(name)+1:])
			out[p] = one
			if fd.Message() != nil && !fd.IsList() && !fd.IsMap() {
				empty := proto.Clone(msg)
				setEmpty(empty.ProtoReflect(), p[len(name)+1:])
				out[p+"/empty"] = empty
				walk(p, v.Message())
			}
			return true
		})
	}
	walk(name, full.ProtoReflect())
	return out
}

// unknownFields are fields GetPodResponse and the messages in it do not
// have, of every wire type (a group with a nested field too), and field 1
// with a wire type it does not have: proto.Unmarshal skips them all.
func unknownFields() []byte {
	b := protowire.AppendVarint(protowire.AppendTag(nil, 1000, protowire.VarintType), 1<<40)
	b = protowire.AppendFixed32(protowire.AppendTag(b, 1001, protowire.Fixed32Type), 7)
	b = protowire.AppendFixed64(protowire.AppendTag(b, 1002, protowire.Fixed64Type), 8)
	b = protowire.AppendString(protowire.AppendTag(b, 1003, protowire.BytesType), "unknown")
	b = protowire.AppendTag(b, 1004, protowire.StartGroupType)
	b = protowire.AppendVarint(protowire.AppendTag(b, 1, protowire.VarintType), 3)
	b = protowire.AppendTag(b, 1004, protowire.EndGroupType)
	return protowire.AppendFixed32(protowire.AppendTag(b, 1, protowire.Fixed32Type), 9)
}

// withUnknown sets unknownFields on m and on every message below it.
func withUnknown(m protoreflect.Message) {
	m.SetUnknown(unknownFields())
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() != nil && !fd.IsList() && !fd.IsMap() {
			withUnknown(v.Message())
		}
		return true
	})
}

// checkRecord decodes b with unmarshalRecord and with proto.Unmarshal:
// both fail, or both give the same GetPodResponse (unknown fields aside).
func checkRecord(t *testing.T, b []byte) {
	t.Helper()
	got, err := unmarshalRecord(b)
	want := &cniv1.GetPodResponse{}
	perr := proto.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, want)
	switch {
	case err != nil && perr != nil:
		if !errors.Is(err, pbwire.ErrMalformed) {
			t.Fatalf("unmarshalRecord(%x) = %v, not an ErrMalformed", b, err)
		}
		return
	case err != nil:
		t.Fatalf("unmarshalRecord(%x) = %v; proto.Unmarshal decodes it", b, err)
	case perr != nil:
		t.Fatalf("unmarshalRecord(%x) decodes what proto.Unmarshal rejects: %v", b, perr)
	}
	if g := recordPB(got); !proto.Equal(g, want) {
		t.Fatalf("unmarshalRecord(%x)\n got %v\nwant %v", b, g, want)
	}
}

// TestUnmarshalMatchesProto: GetPodResponse, fully populated, each field
// alone, each message field present but empty, with unknown fields in every
// message, and two messages one after the other (a merge), decodes to the
// values proto.Marshal encoded.
func TestUnmarshalMatchesProto(t *testing.T) {
	det := proto.MarshalOptions{Deterministic: true}
	for name, m := range variants(t, &cniv1.GetPodResponse{}) {
		t.Run(name, func(t *testing.T) {
			b, err := det.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			got, err := unmarshalRecord(b)
			if err != nil {
				t.Fatal(err)
			}
			if g := recordPB(got); !proto.Equal(g, m) {
				t.Fatalf("decoded\n got %v\nwant %v", g, m)
			}
			u := proto.Clone(m)
			withUnknown(u.ProtoReflect())
			if b, err = det.Marshal(u); err != nil {
				t.Fatal(err)
			}
			got, err = unmarshalRecord(b)
			if err != nil {
				t.Fatalf("with unknown fields: %v", err)
			}
			if g := recordPB(got); !proto.Equal(g, m) {
				t.Fatalf("with unknown fields, decoded\n got %v\nwant %v", g, m)
			}
		})
	}
	a, b := &cniv1.GetPodResponse{}, &cniv1.GetPodResponse{}
	fill(t, a.ProtoReflect(), 1)
	fill(t, b.ProtoReflect(), 2)
	b.GetPod().Pid = &wrapperspb.UInt32Value{} // a merged empty wrapper keeps a's value
	ab, _ := det.Marshal(a)
	bb, _ := det.Marshal(b)
	checkRecord(t, append(ab, bb...))
}

// TestUnmarshalRejects: malformed answers are errors naming ErrMalformed,
// and proto.Unmarshal rejects each of them too.
func TestUnmarshalRejects(t *testing.T) {
	full := &cniv1.GetPodResponse{}
	fill(t, full.ProtoReflect(), 1)
	good, _ := proto.MarshalOptions{Deterministic: true}.Marshal(full)
	bad := map[string][]byte{
		"truncated":             good[:len(good)-1],
		"field number 0":        {0x00, 0x01},
		"field number too big":  protowire.AppendTag(nil, 1<<29, protowire.VarintType),
		"overlong varint":       {0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02},
		"lone end group":        protowire.AppendTag(nil, 9, protowire.EndGroupType),
		"wire type 6":           {0x0e},
		"unterminated group":    protowire.AppendTag(nil, 9, protowire.StartGroupType),
		"mismatched end group":  protowire.AppendTag(protowire.AppendTag(nil, 9, protowire.StartGroupType), 8, protowire.EndGroupType),
		"pod truncated inside":  {0x0a, 0x02, 0x0a, 0x05},
		"invalid UTF-8 name":    {0x0a, 0x03, 0x0a, 0x01, 0xff},
		"invalid UTF-8 map key": {0x0a, 0x05, 0x32, 0x03, 0x0a, 0x01, 0xc3},
		"length past the end":   {0x2a, 0x7f},
	}
	for name, b := range bad {
		t.Run(name, func(t *testing.T) {
			if err := proto.Unmarshal(b, &cniv1.GetPodResponse{}); err == nil {
				t.Fatalf("proto.Unmarshal(%x) accepts it: not a malformed case", b)
			}
			if _, err := unmarshalRecord(b); !errors.Is(err, pbwire.ErrMalformed) {
				t.Fatalf("unmarshalRecord(%x) = %v, want ErrMalformed", b, err)
			}
		})
	}
}

// FuzzUnmarshal holds the hand decoders to proto.Unmarshal on any input:
// the same answer or both an error, and never a panic.
func FuzzUnmarshal(f *testing.F) {
	det := proto.MarshalOptions{Deterministic: true}
	for _, m := range variants(f, &cniv1.GetPodResponse{}) {
		b, err := det.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(unknownFields())
	f.Add([]byte{0x08, 0x03})
	f.Fuzz(func(t *testing.T, b []byte) {
		checkRecord(t, b)
		res, err := resultField(b)
		var want cniv1.AddPodResponse
		perr := proto.Unmarshal(b, &want)
		if (err == nil) != (perr == nil) || (err == nil && res != int32(want.GetResult())) {
			t.Fatalf("resultField(%x) = %d, %v; proto.Unmarshal: %d, %v", b, res, err, want.GetResult(), perr)
		}
	})
}
