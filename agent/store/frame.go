package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// fileMagic opens every record log; a file that starts otherwise is not
// ours and is refused.
const fileMagic = "aether-agent-log/v1\n"

// headerSize is the length of fileMagic: the first frame's offset.
const headerSize = int64(len(fileMagic))

// frameHeader is a frame's length (4 bytes, big endian, of the payload)
// and CRC-32C (4 bytes, big endian, over the length bytes and the payload).
const frameHeader = 8

// maxPayload bounds a frame's payload: larger lengths are damage (a pod
// record is about 1 KiB; Kubernetes caps a pod's annotations at 256 KiB).
const maxPayload = 8 << 20

// Payload kinds: the first byte of every payload.
const (
	kindPut    = 'P' // followed by the record's JSON envelope
	kindDelete = 'D' // followed by the key
)

// appendFrame appends the frame of payload kind+body to dst.
func appendFrame(dst []byte, kind byte, body []byte) []byte {
	n := 1 + len(body)
	start := len(dst)
	dst = binary.BigEndian.AppendUint32(dst, uint32(n))
	dst = append(dst, 0, 0, 0, 0)
	dst = append(dst, kind)
	dst = append(dst, body...)
	sum := crc32.Update(crc32.Checksum(dst[start:start+4], castagnoli), castagnoli, dst[start+frameHeader:])
	binary.BigEndian.PutUint32(dst[start+4:], sum)
	return dst
}

// frameSize is the on-disk size of a frame whose body is n bytes.
func frameSize(n int) int64 { return int64(frameHeader + 1 + n) }

// errEnd is parseFrame's answer at a zero length: the preallocated,
// never written space after the last frame.
var errEnd = errors.New("end of log")

// parseFrame reads the frame at the start of b and returns its kind, body
// and size. It fails (errEnd at a zero length) when the frame is not whole
// and intact: a length of zero or above maxPayload, a frame running past
// b, a checksum mismatch or an unknown kind.
func parseFrame(b []byte) (kind byte, body []byte, size int64, err error) {
	if len(b) < frameHeader {
		if len(bytes.Trim(b, "\x00")) == 0 {
			return 0, nil, 0, errEnd
		}
		return 0, nil, 0, fmt.Errorf("%d bytes are too short for a frame header", len(b))
	}
	n := binary.BigEndian.Uint32(b)
	if n == 0 {
		return 0, nil, 0, errEnd
	}
	if n > maxPayload || int64(n) > int64(len(b)-frameHeader) {
		return 0, nil, 0, fmt.Errorf("frame length %d runs past the end or the %d-byte limit", n, maxPayload)
	}
	payload := b[frameHeader : frameHeader+int(n)]
	// The kind first: it rules out most offsets resync tries without a
	// checksum over up to maxPayload bytes.
	if payload[0] != kindPut && payload[0] != kindDelete {
		return 0, nil, 0, fmt.Errorf("frame of unknown kind %q", payload[0])
	}
	if got, want := crc32.Update(crc32.Checksum(b[:4], castagnoli), castagnoli, payload), binary.BigEndian.Uint32(b[4:]); got != want {
		return 0, nil, 0, fmt.Errorf("frame checksum %08x does not match stored %08x", got, want)
	}
	return payload[0], payload[1:], frameHeader + int64(n), nil
}

// resync returns the offset in b of the first intact frame after the
// damaged one at its start, or -1 when none follows: the damage is then a
// torn tail.
func resync(b []byte) int64 {
	for q := 1; q+frameHeader < len(b); q++ {
		if b[q]|b[q+1]|b[q+2]|b[q+3] == 0 {
			// A frame's length has a non-zero byte: skip the zero run (the
			// preallocated space after the last frame) in one tight loop.
			nz := q + 4
			for nz < len(b) && b[nz] == 0 {
				nz++
			}
			q = nz - 4 // the next try's length ends with b[nz]
			continue
		}
		if _, _, _, err := parseFrame(b[q:]); err == nil {
			return int64(q)
		}
	}
	return -1
}
