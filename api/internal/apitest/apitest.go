// Package apitest holds checks shared by the API packages' tests.
package apitest

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// RoundTrip marshals and unmarshals every message, failing unless each
// survives unchanged, and fails for every message of fd without a case.
func RoundTrip(t *testing.T, fd protoreflect.FileDescriptor, msgs ...proto.Message) {
	t.Helper()
	covered := map[protoreflect.FullName]bool{}
	for _, m := range msgs {
		covered[m.ProtoReflect().Descriptor().FullName()] = true
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatalf("marshal %T: %v", m, err)
		}
		got := m.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(b, got); err != nil {
			t.Fatalf("unmarshal %T: %v", m, err)
		}
		if !proto.Equal(m, got) {
			t.Fatalf("%T did not survive a round trip", m)
		}
	}
	for i := range fd.Messages().Len() {
		if name := fd.Messages().Get(i).FullName(); !covered[name] {
			t.Errorf("message %s has no round-trip case", name)
		}
	}
}
