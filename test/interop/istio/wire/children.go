package wire

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// children returns every populated sub-message of m (singular, repeated and
// map values), so a decode check can look for unknown fields at each level.
func children(m proto.Message) []proto.Message {
	var out []proto.Message
	m.ProtoReflect().Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() != nil {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					out = append(out, mv.Message().Interface())
					return true
				})
			}
		case fd.IsList():
			if fd.Message() != nil {
				for i := range v.List().Len() {
					out = append(out, v.List().Get(i).Message().Interface())
				}
			}
		case fd.Message() != nil:
			out = append(out, v.Message().Interface())
		}
		return true
	})
	return out
}
