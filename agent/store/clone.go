package store

import "google.golang.org/protobuf/proto"

func cloneProto[T proto.Message](m T) T { return proto.Clone(m).(T) }
