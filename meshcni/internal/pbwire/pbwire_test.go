package pbwire

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// TestVarintMatchesProtowire: every varint length, both ends of each, and
// tags of the smallest and largest field numbers, as protowire writes and
// reads them.
func TestVarintMatchesProtowire(t *testing.T) {
	var vs []uint64
	for bits := 0; bits <= 64; bits += 7 {
		if bits < 64 {
			vs = append(vs, 1<<bits, 1<<bits-1, 1<<bits+1)
		}
	}
	vs = append(vs, 0, 1<<63, ^uint64(0))
	for _, v := range vs {
		want := protowire.AppendVarint(nil, v)
		got := AppendVarint(nil, v)
		if !bytes.Equal(got, want) || SizeVarint(v) != len(want) {
			t.Fatalf("varint %d: got %x (size %d), want %x", v, got, SizeVarint(v), want)
		}
		if back, n := consumeVarint(got); back != v || n != len(got) {
			t.Fatalf("consumeVarint(%x) = %d, %d", got, back, n)
		}
		if _, n := consumeVarint(got[:len(got)-1]); n >= 0 {
			t.Fatalf("consumeVarint of truncated %x: %d, want an error", got[:len(got)-1], n)
		}
	}
	for _, num := range []int32{1, 15, 16, 2047, 2048, maxNumber} {
		if got, want := AppendTag(nil, num, BytesType), protowire.AppendTag(nil, protowire.Number(num), protowire.BytesType); !bytes.Equal(got, want) {
			t.Fatalf("tag %d: got %x, want %x", num, got, want)
		}
	}
	// Ten bytes whose last carries more than bit 63.
	if _, n := consumeVarint([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02}); n >= 0 {
		t.Fatal("a varint overflowing 64 bits decoded")
	}
}

// TestAppendMessageLengthPrefix: a body of 127 bytes keeps a one-byte
// prefix, 128 and more move the body for a longer one.
func TestAppendMessageLengthPrefix(t *testing.T) {
	for _, n := range []int{0, 1, 127, 128, 16383, 16384} {
		body := strings.Repeat("x", n)
		got := AppendMessage([]byte{0xaa}, 3, func(b []byte) []byte { return append(b, body...) })
		want := protowire.AppendBytes(protowire.AppendTag([]byte{0xaa}, 3, protowire.BytesType), []byte(body))
		if !bytes.Equal(got, want) {
			t.Fatalf("body of %d bytes: encodings differ", n)
		}
	}
}

// TestDecode: every wire type reaches fn with its number and type; a field
// of a known number but another wire type is left alone by the setters.
func TestDecode(t *testing.T) {
	b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 300)
	b = protowire.AppendString(protowire.AppendTag(b, 2, protowire.BytesType), "héllo")
	b = protowire.AppendFixed32(protowire.AppendTag(b, 3, protowire.Fixed32Type), 1)
	b = protowire.AppendFixed64(protowire.AppendTag(b, 4, protowire.Fixed64Type), 1)
	b = protowire.AppendTag(b, 5, protowire.StartGroupType)
	b = protowire.AppendTag(protowire.AppendTag(b, 6, protowire.StartGroupType), 6, protowire.EndGroupType)
	b = protowire.AppendTag(b, 5, protowire.EndGroupType)
	b = protowire.AppendString(protowire.AppendTag(b, 1, protowire.BytesType), "not a varint")
	var (
		seen []Type
		u    uint64
		s    string
	)
	err := Decode(b, func(f Field) error {
		seen = append(seen, f.Type)
		switch f.Num {
		case 1:
			f.Uint(&u)
		case 2:
			return f.String(&s)
		}
		return nil
	})
	want := []Type{VarintType, BytesType, Fixed32Type, Fixed64Type, StartGroupType, BytesType}
	if err != nil || u != 300 || s != "héllo" || !slices.Equal(seen, want) {
		t.Fatalf("Decode: err %v, u %d, s %q, types %v", err, u, s, seen)
	}
	stop := errors.New("stop")
	if err := Decode(b, func(Field) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("Decode returned %v, want fn's error", err)
	}
	if err := Decode([]byte{0x12, 0x01, 0xff}, func(f Field) error { return f.String(&s) }); !errors.Is(err, ErrMalformed) {
		t.Fatalf("invalid UTF-8 string: %v", err)
	}
}

// TestPackedUint32: AppendPackedUint32 writes what protowire writes for a
// packed repeated uint32 (nothing when empty), and AppendUint32s reads it
// back, and also the unpacked form protobuf parsers must accept; a
// truncated packed payload is malformed.
func TestPackedUint32(t *testing.T) {
	vs := []uint32{1, 127, 128, 15008, 65535, 1 << 31}
	var body []byte
	for _, v := range vs {
		body = protowire.AppendVarint(body, uint64(v))
	}
	want := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), body)
	if got := AppendPackedUint32(nil, 1, vs); !bytes.Equal(got, want) {
		t.Fatalf("packed: got %x, want %x", got, want)
	}
	if got := AppendPackedUint32(nil, 1, nil); len(got) != 0 {
		t.Fatalf("empty: got %x, want nothing", got)
	}
	unpacked := []byte{}
	for _, v := range vs {
		unpacked = protowire.AppendVarint(protowire.AppendTag(unpacked, 1, protowire.VarintType), uint64(v))
	}
	for name, b := range map[string][]byte{"packed": want, "unpacked": unpacked} {
		var got []uint32
		if err := Decode(b, func(f Field) error { return f.AppendUint32s(&got) }); err != nil || !slices.Equal(got, vs) {
			t.Fatalf("%s: decoded %v, %v; want %v", name, got, err, vs)
		}
	}
	bad := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte{0x80})
	var got []uint32
	if err := Decode(bad, func(f Field) error { return f.AppendUint32s(&got) }); !errors.Is(err, ErrMalformed) {
		t.Fatalf("truncated packed varint: %v, want ErrMalformed", err)
	}
}
