// Package pbwire is the part of the protobuf wire format aether-cni needs:
// varints, tags and length-delimited fields to encode its requests, and a
// field-by-field decoder for the answers, with the rules proto.Unmarshal
// applies (field numbers 1 to 2^29-1, a field of a known number but another
// wire type skipped as unknown, groups skipped whole, proto3 strings valid
// UTF-8). Malformed input is an error, never a panic.
//
// It replaces google.golang.org/protobuf in the plugin: the plugin is
// exec'd once per pod and verb, and the protobuf runtime's package init
// (descriptor builds, internal/detrand reading the executable) cost every
// exec more than its few small messages (meshcni/README.md, "Start-up").
// Messages themselves are plain Go types where they are used
// (meshcni/agentclient, meshcni/podpid); their tests hold the encodings
// against the generated code.
package pbwire

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// Type is a wire type.
type Type uint8

// The wire types.
const (
	VarintType     Type = 0
	Fixed64Type    Type = 1
	BytesType      Type = 2
	StartGroupType Type = 3
	EndGroupType   Type = 4
	Fixed32Type    Type = 5
)

const (
	// maxNumber is the largest valid field number.
	maxNumber = 1<<29 - 1
	// maxGroupDepth bounds the nesting of skipped groups, as protobuf's
	// default recursion limit does.
	maxGroupDepth = 10000
)

// ErrMalformed is wrapped by every decoding error.
var ErrMalformed = errors.New("malformed protobuf message")

func malformed(what string) error { return fmt.Errorf("%w: %s", ErrMalformed, what) }

// AppendVarint appends v as a varint.
func AppendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

// SizeVarint is the length of v as a varint.
func SizeVarint(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// AppendTag appends the tag of field num with wire type typ.
func AppendTag(b []byte, num int32, typ Type) []byte {
	return AppendVarint(b, uint64(num)<<3|uint64(typ))
}

// AppendBytesField appends field num holding s, also when s is empty (a
// repeated element).
func AppendBytesField(b []byte, num int32, s string) []byte {
	b = AppendTag(b, num, BytesType)
	b = AppendVarint(b, uint64(len(s)))
	return append(b, s...)
}

// AppendString appends the proto3 string field num: nothing when s is empty.
func AppendString(b []byte, num int32, s string) []byte {
	if s == "" {
		return b
	}
	return AppendBytesField(b, num, s)
}

// AppendRepeatedString appends one field num per element of ss.
func AppendRepeatedString(b []byte, num int32, ss []string) []byte {
	for _, s := range ss {
		b = AppendBytesField(b, num, s)
	}
	return b
}

// AppendUint appends the proto3 varint field num: nothing when v is 0.
// Signed values are passed sign-extended (uint64(int64(v))), as int32 and
// int64 fields are encoded.
func AppendUint(b []byte, num int32, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = AppendTag(b, num, VarintType)
	return AppendVarint(b, v)
}

// AppendPackedUint32 appends the repeated uint32 field num packed, as
// proto3 encodes it: nothing when vs is empty.
func AppendPackedUint32(b []byte, num int32, vs []uint32) []byte {
	if len(vs) == 0 {
		return b
	}
	n := 0
	for _, v := range vs {
		n += SizeVarint(uint64(v))
	}
	b = AppendTag(b, num, BytesType)
	b = AppendVarint(b, uint64(n))
	for _, v := range vs {
		b = AppendVarint(b, uint64(v))
	}
	return b
}

// AppendBool appends the proto3 bool field num: nothing when v is false.
func AppendBool(b []byte, num int32, v bool) []byte {
	if !v {
		return b
	}
	return AppendUint(b, num, 1)
}

// AppendMessage appends field num holding the message body appends (also
// an empty one: a present message field).
func AppendMessage(b []byte, num int32, body func([]byte) []byte) []byte {
	b = AppendTag(b, num, BytesType)
	at := len(b)
	b = body(b)
	n := len(b) - at
	// Move the body right by the length prefix's size and write the prefix.
	size := SizeVarint(uint64(n))
	b = append(b, make([]byte, size)...)
	copy(b[at+size:], b[at:at+n])
	AppendVarint(b[at:at], uint64(n))
	return b
}

// Field is one decoded field. Varint holds a VarintType field's value and
// Bytes a BytesType field's payload (a slice of the input); other wire
// types carry neither and are for skipping.
type Field struct {
	Num    int32
	Type   Type
	Varint uint64
	Bytes  []byte
}

// String sets *dst to a BytesType field's payload, which must be UTF-8 (a
// proto3 string); a field of another wire type is left alone (unknown).
func (f Field) String(dst *string) error {
	if f.Type != BytesType {
		return nil
	}
	if !utf8.Valid(f.Bytes) {
		return malformed(fmt.Sprintf("field %d: string is not valid UTF-8", f.Num))
	}
	*dst = string(f.Bytes)
	return nil
}

// AppendTo appends a BytesType field's payload, which must be UTF-8, to
// *dst (a repeated string).
func (f Field) AppendTo(dst *[]string) error {
	var s string
	if f.Type != BytesType {
		return nil
	}
	if err := f.String(&s); err != nil {
		return err
	}
	*dst = append(*dst, s)
	return nil
}

// Uint sets *dst to a VarintType field's value; other wire types are left
// alone. Narrower fields truncate it, as protobuf does.
func (f Field) Uint(dst *uint64) {
	if f.Type == VarintType {
		*dst = f.Varint
	}
}

// Uint32 is Uint for a uint32 field.
func (f Field) Uint32(dst *uint32) {
	if f.Type == VarintType {
		*dst = uint32(f.Varint)
	}
}

// Int32 is Uint for an int32 or enum field.
func (f Field) Int32(dst *int32) {
	if f.Type == VarintType {
		*dst = int32(f.Varint)
	}
}

// Int64 is Uint for an int64 field.
func (f Field) Int64(dst *int64) {
	if f.Type == VarintType {
		*dst = int64(f.Varint)
	}
}

// Bool is Uint for a bool field (any non-zero value is true).
func (f Field) Bool(dst *bool) {
	if f.Type == VarintType {
		*dst = f.Varint != 0
	}
}

// AppendUint32s appends a repeated uint32 field's elements to *dst: one
// element of a VarintType field, or every element of a packed (BytesType)
// one, as protobuf accepts both; values are truncated to 32 bits.
func (f Field) AppendUint32s(dst *[]uint32) error {
	switch f.Type {
	case VarintType:
		*dst = append(*dst, uint32(f.Varint))
	case BytesType:
		for b := f.Bytes; len(b) > 0; {
			v, n := consumeVarint(b)
			if n < 0 {
				return malformed(fmt.Sprintf("field %d: truncated or overlong packed varint", f.Num))
			}
			*dst = append(*dst, uint32(v))
			b = b[n:]
		}
	}
	return nil
}

// StringMapEntry adds the map<string, string> entry a BytesType field
// holds to *m, creating the map (a missing key or value is ""; a key seen
// again takes the later value); other wire types are left alone.
func (f Field) StringMapEntry(m *map[string]string) error {
	if f.Type != BytesType {
		return nil
	}
	var k, v string
	err := Decode(f.Bytes, func(f Field) error {
		switch f.Num {
		case 1:
			return f.String(&k)
		case 2:
			return f.String(&v)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if *m == nil {
		*m = map[string]string{}
	}
	(*m)[k] = v
	return nil
}

// Message decodes a BytesType field's payload with decode; other wire
// types are left alone.
func (f Field) Message(decode func([]byte) error) error {
	if f.Type != BytesType {
		return nil
	}
	return decode(f.Bytes)
}

// Decode calls fn with every field of the message in b, in order. Fields
// fn does not know it ignores: Decode has already checked and skipped them.
func Decode(b []byte, fn func(Field) error) error {
	for len(b) > 0 {
		tag, n := consumeVarint(b)
		if n < 0 {
			return malformed("truncated or overlong tag")
		}
		b = b[n:]
		if tag>>3 < 1 || tag>>3 > maxNumber {
			return malformed(fmt.Sprintf("field number %d", tag>>3))
		}
		f := Field{Num: int32(tag >> 3), Type: Type(tag & 7)}
		switch f.Type {
		case VarintType:
			f.Varint, n = consumeVarint(b)
		case BytesType:
			f.Bytes, n = consumeBytes(b)
		default:
			n = skipValue(uint64(f.Num), f.Type, b, maxGroupDepth)
		}
		if n < 0 {
			return malformed(fmt.Sprintf("field %d: truncated or invalid value of wire type %d", f.Num, f.Type))
		}
		b = b[n:]
		if err := fn(f); err != nil {
			return err
		}
	}
	return nil
}

// consumeVarint returns the varint at the start of b and its length, or a
// negative length when b is truncated or the varint overflows 64 bits.
func consumeVarint(b []byte) (uint64, int) {
	var v uint64
	for i := 0; i < 10; i++ {
		if i >= len(b) {
			return 0, -1
		}
		c := b[i]
		if i == 9 && c > 1 {
			return 0, -1
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, i + 1
		}
	}
	return 0, -1
}

// consumeBytes returns the length-delimited payload at the start of b and
// the length consumed, or a negative length.
func consumeBytes(b []byte) ([]byte, int) {
	l, n := consumeVarint(b)
	if n < 0 || l > uint64(len(b)-n) {
		return nil, -1
	}
	return b[n : n+int(l)], n + int(l)
}

// skipValue returns the length of the value of field num with wire type
// typ at the start of b (a group up to and including its matching end), or
// a negative length when it is malformed.
func skipValue(num uint64, typ Type, b []byte, depth int) int {
	switch typ {
	case VarintType:
		_, n := consumeVarint(b)
		return n
	case Fixed64Type:
		if len(b) < 8 {
			return -1
		}
		return 8
	case Fixed32Type:
		if len(b) < 4 {
			return -1
		}
		return 4
	case BytesType:
		_, n := consumeBytes(b)
		return n
	case StartGroupType:
		if depth < 0 {
			return -1
		}
		start := len(b)
		for {
			tag, n := consumeVarint(b)
			// Inside a group any number of 1 to 2^31-1 is taken, as
			// protowire.ConsumeTag does.
			if n < 0 || tag>>3 < 1 || tag>>3 > 1<<31-1 {
				return -1
			}
			b = b[n:]
			if Type(tag&7) == EndGroupType {
				if tag>>3 != num {
					return -1
				}
				return start - len(b)
			}
			m := skipValue(tag>>3, Type(tag&7), b, depth-1)
			if m < 0 {
				return -1
			}
			b = b[m:]
		}
	}
	// A lone end of group, or the reserved wire types 6 and 7.
	return -1
}
