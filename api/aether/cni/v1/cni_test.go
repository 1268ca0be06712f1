package cniv1_test

import (
	"slices"
	"strings"
	"testing"

	"buf.build/go/protovalidate"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/internal/apitest"
)

func validPod() *cniv1.CNIPod {
	return &cniv1.CNIPod{
		Name:             "web-0",
		Namespace:        "shop",
		NetworkNamespace: "/run/aether/netns/abc",
		ContainerId:      "abc",
		Ips:              []string{"10.0.0.5", "fd00::5"},
		Labels:           map[string]string{"aether.io/managed": "true"},
		Annotations:      map[string]string{"endpoint.aether.io/uds-socket": "mesh/app.sock"},
		Pid:              wrapperspb.UInt32(42),
		ServiceAccount:   "web",
		Terminating:      true,
		Uid:              "0ae5c03d-5fb3-4eb9-9de8-2bd4b51606ba",
		UdsCsiVolume:     "mesh",
		Volumes:          []string{"mesh", "data"},
		UdsCsiVolumes:    1,
		DeclaredPorts:    &cniv1.DeclaredPorts{Tcp: []uint32{8080, 15090}},
	}
}

func timings() *cniv1.PluginTimings {
	return &cniv1.PluginTimings{
		Started:             timestamppb.Now(),
		PreCall:             durationpb.New(1e6),
		ReadinessProbe:      durationpb.New(2e6),
		ReadinessProbeError: "connection refused",
		CaptureDivert:       durationpb.New(3e6),
		CaptureDivertError:  "netlink: operation not permitted",
		Total:               durationpb.New(9e6),
	}
}

// TestRoundTrip marshals and unmarshals every message of the package with
// every field set.
func TestRoundTrip(t *testing.T) {
	msgs := []proto.Message{
		validPod(),
		&cniv1.DeclaredPorts{Tcp: []uint32{80, 443}},
		&cniv1.AddPodRequest{Pod: validPod(), PluginTimings: timings()},
		&cniv1.AddPodResponse{Result: cniv1.AddPodResponse_RESULT_IGNORED},
		&cniv1.RemovePodRequest{Name: "web-0", Namespace: "shop", ContainerId: "abc", PluginTimings: timings()},
		&cniv1.RemovePodResponse{Result: cniv1.RemovePodResponse_RESULT_SUCCESS},
		timings(),
		&cniv1.ReportAddResultRequest{ContainerId: "abc", Name: "web-0", Namespace: "shop", Timings: timings()},
		&cniv1.ReportAddResultResponse{},
		&cniv1.GetPodRequest{ContainerId: "abc"},
		&cniv1.GetPodResponse{Pod: validPod(), Managed: true, Registered: true, Uncaptured: true, LastTimings: timings()},
	}
	apitest.RoundTrip(t, cniv1.File_aether_cni_v1_cni_proto, msgs...)
}

// TestCNIPodFieldNumbers pins the field numbers shared with the Aether project.
func TestCNIPodFieldNumbers(t *testing.T) {
	want := map[string]protoreflect.FieldNumber{
		"name": 1, "namespace": 2, "network_namespace": 3, "container_id": 4, "ips": 5,
		"labels": 6, "annotations": 7, "pid": 8, "service_account": 9, "terminating": 10,
		"uid": 11, "uds_csi_volume": 12, "volumes": 13, "uds_csi_volumes": 14,
		"declared_ports": 15, // ours, appended
	}
	fields := (&cniv1.CNIPod{}).ProtoReflect().Descriptor().Fields()
	if fields.Len() != len(want) {
		t.Fatalf("CNIPod has %d fields, want %d", fields.Len(), len(want))
	}
	for name, num := range want {
		f := fields.ByName(protoreflect.Name(name))
		if f == nil || f.Number() != num {
			t.Errorf("CNIPod.%s: got %v, want number %d", name, f, num)
		}
	}
	rm := (&cniv1.RemovePodRequest{}).ProtoReflect().Descriptor().Fields()
	for name, num := range map[string]protoreflect.FieldNumber{"name": 1, "namespace": 2, "container_id": 4, "plugin_timings": 5} {
		if f := rm.ByName(protoreflect.Name(name)); f == nil || f.Number() != num {
			t.Errorf("RemovePodRequest.%s: want number %d", name, num)
		}
	}
	add := (&cniv1.AddPodRequest{}).ProtoReflect().Descriptor().Fields()
	for name, num := range map[string]protoreflect.FieldNumber{"pod": 1, "plugin_timings": 2} {
		if f := add.ByName(protoreflect.Name(name)); f == nil || f.Number() != num {
			t.Errorf("AddPodRequest.%s: want number %d", name, num)
		}
	}
	for name, num := range map[string]protoreflect.EnumNumber{"RESULT_UNSPECIFIED": 0, "RESULT_SUCCESS": 1, "RESULT_ERROR": 2, "RESULT_IGNORED": 3} {
		if v := cniv1.AddPodResponse_Result(0).Descriptor().Values().ByName(protoreflect.Name(name)); v == nil || v.Number() != num {
			t.Errorf("AddPodResponse.Result.%s: want %d", name, num)
		}
	}
}

func TestValidationRejectsMissingIdentity(t *testing.T) {
	v, err := protovalidate.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Validate(&cniv1.AddPodRequest{Pod: validPod()}); err != nil {
		t.Fatalf("a valid AddPod was rejected: %v", err)
	}
	cases := map[string]func(*cniv1.CNIPod){
		"name":              func(p *cniv1.CNIPod) { p.Name = "" },
		"namespace":         func(p *cniv1.CNIPod) { p.Namespace = "" },
		"network_namespace": func(p *cniv1.CNIPod) { p.NetworkNamespace = "" },
		"container_id":      func(p *cniv1.CNIPod) { p.ContainerId = "" },
	}
	for field, mutate := range cases {
		p := validPod()
		mutate(p)
		err := v.Validate(&cniv1.AddPodRequest{Pod: p})
		if err == nil {
			t.Errorf("AddPod without %s was accepted", field)
			continue
		}
		if !strings.Contains(err.Error(), field) {
			t.Errorf("AddPod without %s: error %q does not name the field", field, err)
		}
	}
	if err := v.Validate(&cniv1.AddPodRequest{}); err == nil {
		t.Error("AddPod without a pod was accepted")
	}
	bad := validPod()
	bad.NetworkNamespace = "relative/path"
	if err := v.Validate(&cniv1.AddPodRequest{Pod: bad}); err == nil {
		t.Error("a relative network_namespace was accepted")
	}
	bad = validPod()
	bad.Ips = []string{"10.0.0.300"}
	if err := v.Validate(&cniv1.AddPodRequest{Pod: bad}); err == nil {
		t.Error("an invalid IP was accepted")
	}
	for _, port := range []uint32{0, 65536} {
		bad = validPod()
		bad.DeclaredPorts = &cniv1.DeclaredPorts{Tcp: []uint32{80, port}}
		if err := v.Validate(&cniv1.AddPodRequest{Pod: bad}); err == nil {
			t.Errorf("declared port %d was accepted", port)
		}
	}
	if err := v.Validate(&cniv1.RemovePodRequest{Name: "a", Namespace: "b"}); err == nil {
		t.Error("RemovePod without container_id was accepted")
	}
}

// TestPluginTimingsWireCompatibility: plugin_timings are new fields of
// AddPodRequest (2) and RemovePodRequest (5). A request from a plugin that
// predates them decodes with none, and a request that carries them decodes
// in a message of the old shape (what an agent that predates them sees)
// with the timings as an unknown field and every other field intact.
func TestPluginTimingsWireCompatibility(t *testing.T) {
	for _, tc := range []struct {
		name     string
		old, new proto.Message
		// blank returns an empty message of the new shape.
		blank func() proto.Message
		// timings reads plugin_timings off a message of the new shape.
		timings func(proto.Message) *cniv1.PluginTimings
	}{
		{
			name:    "AddPodRequest",
			old:     &cniv1.AddPodRequest{Pod: validPod()},
			new:     &cniv1.AddPodRequest{Pod: validPod(), PluginTimings: timings()},
			blank:   func() proto.Message { return &cniv1.AddPodRequest{} },
			timings: func(m proto.Message) *cniv1.PluginTimings { return m.(*cniv1.AddPodRequest).GetPluginTimings() },
		},
		{
			name:    "RemovePodRequest",
			old:     &cniv1.RemovePodRequest{Name: "web-0", Namespace: "shop", ContainerId: "abc"},
			new:     &cniv1.RemovePodRequest{Name: "web-0", Namespace: "shop", ContainerId: "abc", PluginTimings: timings()},
			blank:   func() proto.Message { return &cniv1.RemovePodRequest{} },
			timings: func(m proto.Message) *cniv1.PluginTimings { return m.(*cniv1.RemovePodRequest).GetPluginTimings() },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Old plugin -> new agent: no timings, nothing else lost.
			b, err := proto.Marshal(tc.old)
			if err != nil {
				t.Fatal(err)
			}
			got := tc.blank()
			if err := proto.Unmarshal(b, got); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tc.old) || tc.timings(got) != nil {
				t.Fatalf("old-shape request decoded as %v, want %v without plugin_timings", got, tc.old)
			}
			// New plugin -> old agent: decode into the message as the old
			// proto declares it (this file without plugin_timings). The
			// field is unknown there, everything else is read, and the
			// unknown bytes survive a re-encode.
			b, err = proto.Marshal(tc.new)
			if err != nil {
				t.Fatal(err)
			}
			oldMsg := dynamicpb.NewMessage(withoutPluginTimings(t, tc.new.ProtoReflect().Descriptor().Name()))
			if err := proto.Unmarshal(b, oldMsg); err != nil {
				t.Fatalf("old agent failed to decode a new request: %v", err)
			}
			if len(oldMsg.GetUnknown()) == 0 {
				t.Fatal("plugin_timings not kept as an unknown field by the old shape")
			}
			old, err := proto.Marshal(tc.old)
			if err != nil {
				t.Fatal(err)
			}
			want := dynamicpb.NewMessage(oldMsg.Descriptor())
			if err := proto.Unmarshal(old, want); err != nil {
				t.Fatal(err)
			}
			oldMsg.SetUnknown(nil)
			if !proto.Equal(oldMsg, want) {
				t.Fatalf("old agent read %v, want %v", oldMsg, want)
			}
			v, err := protovalidate.New()
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range []proto.Message{tc.old, tc.new} {
				if err := v.Validate(m); err != nil {
					t.Errorf("%v rejected: %v", m, err)
				}
			}
		})
	}
}

// withoutPluginTimings returns message name as the proto declared it before
// plugin_timings existed.
func withoutPluginTimings(t *testing.T, name protoreflect.Name) protoreflect.MessageDescriptor {
	t.Helper()
	fdp := protodesc.ToFileDescriptorProto(cniv1.File_aether_cni_v1_cni_proto)
	for _, m := range fdp.GetMessageType() {
		if m.GetName() == string(name) {
			m.Field = slices.DeleteFunc(m.Field, func(f *descriptorpb.FieldDescriptorProto) bool {
				return f.GetName() == "plugin_timings"
			})
		}
	}
	f, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		t.Fatal(err)
	}
	md := f.Messages().ByName(name)
	if md == nil || md.Fields().ByName("plugin_timings") != nil {
		t.Fatalf("no old shape of %s", name)
	}
	return md
}
