package hbone

import (
	"encoding/binary"
	"strconv"

	"golang.org/x/net/http2"
)

// HTTP/2 wire constants of the server engine (RFC 9113).
const (
	frameHeaderLen = 9
	// clientPreface is what every HTTP/2 client sends first (RFC 9113 §3.4).
	clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	// initialWindow is the flow-control window before SETTINGS apply.
	initialWindow = 65535
	// maxWindow is the largest flow-control window (2^31-1).
	maxWindow = 1<<31 - 1
	// maxHeaderList is the SETTINGS_MAX_HEADER_LIST_SIZE the server
	// advertises: a CONNECT request is a few short fields.
	maxHeaderList = 64 << 10
	// maxQueuedControl bounds the control frames (PING and SETTINGS acks,
	// RST_STREAM, refusals, WINDOW_UPDATE) queued for a client that does
	// not read them: a client that keeps sending frames that need an answer
	// (a PING, SETTINGS or reset flood, CVE-2019-9512/9515) without
	// reading loses its connection instead of growing the server's memory.
	// net/http's server closes after 10,000 queued frames; 1 MiB is
	// 58,000 PING acks and far more than any peer that reads ever leaves.
	maxQueuedControl = 1 << 20
)

// appendFrameHeader appends the 9-byte header of a frame.
func appendFrameHeader(b []byte, length int, typ http2.FrameType, flags http2.Flags, stream uint32) []byte {
	return append(b, byte(length>>16), byte(length>>8), byte(length), byte(typ), byte(flags),
		byte(stream>>24), byte(stream>>16), byte(stream>>8), byte(stream))
}

// putFrameHeader writes the header of a frame into b[:9].
func putFrameHeader(b []byte, length int, typ http2.FrameType, flags http2.Flags, stream uint32) {
	appendFrameHeader(b[:0], length, typ, flags, stream)
}

func appendSettings(b []byte, settings ...http2.Setting) []byte {
	b = appendFrameHeader(b, 6*len(settings), http2.FrameSettings, 0, 0)
	for _, s := range settings {
		b = binary.BigEndian.AppendUint16(b, uint16(s.ID))
		b = binary.BigEndian.AppendUint32(b, s.Val)
	}
	return b
}

func appendSettingsAck(b []byte) []byte {
	return appendFrameHeader(b, 0, http2.FrameSettings, http2.FlagSettingsAck, 0)
}

func appendWindowUpdate(b []byte, stream uint32, inc uint32) []byte {
	b = appendFrameHeader(b, 4, http2.FrameWindowUpdate, 0, stream)
	return binary.BigEndian.AppendUint32(b, inc&maxWindow)
}

func appendRSTStream(b []byte, stream uint32, code http2.ErrCode) []byte {
	b = appendFrameHeader(b, 4, http2.FrameRSTStream, 0, stream)
	return binary.BigEndian.AppendUint32(b, uint32(code))
}

func appendGoAway(b []byte, last uint32, code http2.ErrCode) []byte {
	b = appendFrameHeader(b, 8, http2.FrameGoAway, 0, 0)
	b = binary.BigEndian.AppendUint32(b, last&maxWindow)
	return binary.BigEndian.AppendUint32(b, uint32(code))
}

func appendPing(b []byte, ack bool, data [8]byte) []byte {
	var flags http2.Flags
	if ack {
		flags = http2.FlagPingAck
	}
	b = appendFrameHeader(b, 8, http2.FramePing, flags, 0)
	return append(b, data[:]...)
}

// appendStatus appends a HEADERS frame carrying only :status (END_HEADERS,
// and END_STREAM when end). The field is encoded without the HPACK dynamic
// table (RFC 7541: an indexed static entry, or a literal "without
// indexing" with the static name :status), so header blocks carry no
// encoder state and can be written in any order.
func appendStatus(b []byte, stream uint32, code int, end bool) []byte {
	var block []byte
	switch code {
	case 200:
		block = []byte{0x88} // static table entry 8, ":status: 200"
	default:
		v := strconv.Itoa(code)
		block = append([]byte{0x08, byte(len(v))}, v...) // literal, name = static entry 8
	}
	flags := http2.FlagHeadersEndHeaders
	if end {
		flags |= http2.FlagHeadersEndStream
	}
	b = appendFrameHeader(b, len(block), http2.FrameHeaders, flags, stream)
	return append(b, block...)
}
