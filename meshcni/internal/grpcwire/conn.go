// Package grpcwire is a minimal gRPC client for unary calls: the gRPC wire
// protocol (PROTOCOL-HTTP2.md) over one cleartext HTTP/2 connection on a
// unix socket, with nothing else (no name resolution, balancing, TLS,
// compression, streaming, keepalive or retries).
//
// aether-cni is exec'd once per pod and verb and makes one to three calls:
// grpc-go, and the net/http, crypto/tls and protobuf JSON packages it
// links, cost every exec more package init and page faults than the calls
// themselves (meshcni/README.md, "Start-up"). x/net's http2.Framer would
// link net/http and crypto/tls again: +45 package inits and +9-14 % CPU per
// exec measured (meshcni/README.md, "Why grpcwire frames HTTP/2 itself").
// The agent keeps serving with
// grpc-go; the tests of meshcni/agentclient run this client against it.
//
// One call runs at a time on a Conn. A call that fails on the connection
// (I/O error, deadline, protocol error, GOAWAY) closes it; the next call
// dials again.
package grpcwire

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/http2/hpack"
)

// HTTP/2 frame types and flags (RFC 9113 section 6) this client uses.
const (
	frameData         = 0x0
	frameHeaders      = 0x1
	frameRSTStream    = 0x3
	frameSettings     = 0x4
	framePing         = 0x6
	frameGoAway       = 0x7
	frameWindowUpdate = 0x8
	frameContinuation = 0x9

	flagEndStream  = 0x1
	flagAck        = 0x1
	flagEndHeaders = 0x4
	flagPadded     = 0x8
	flagPriority   = 0x20

	settingInitialWindowSize = 0x4
	settingMaxFrameSize      = 0x5

	preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	// defaultWindow and defaultMaxFrame are HTTP/2's initial values.
	defaultWindow   = 65535
	defaultMaxFrame = 16384
	// maxResponse bounds a response message, as grpc-go's default
	// MaxCallRecvMsgSize does.
	maxResponse = 4 << 20
	// windowRefill: received DATA is returned to the server's send window
	// once this much has accumulated (small responses never need it).
	windowRefill = defaultWindow / 2
)

// Conn is a client connection to one unix socket. The zero value is not
// usable; call New.
type Conn struct {
	socket string

	mu    sync.Mutex // one call at a time; guards everything below
	dial  *dialing   // the connection, made or being made; nil = none
	id    uint32     // the last stream ID used on dial's connection
	enc   *hpack.Encoder
	encb  bytes.Buffer
	dec   *hpack.Decoder
	rbuf  []byte
	frame uint32 // the server's SETTINGS_MAX_FRAME_SIZE
	win   int64  // the server's initial stream window
	send  int64  // what is left of the connection's send window
	recv  int    // DATA received since the last WINDOW_UPDATE
}

// dialing is one connection attempt; done is closed once conn or err is set.
type dialing struct {
	done   chan struct{}
	cancel context.CancelFunc
	conn   net.Conn
	err    error
}

// New returns a client of the gRPC server on socket; no I/O happens here.
func New(socket string) *Conn { return &Conn{socket: socket} }

// Connect starts connecting in the background, if no connection is made or
// being made, and returns at once.
func (c *Conn) Connect() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.startDial()
}

func (c *Conn) startDial() *dialing {
	if c.dial != nil {
		return c.dial
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &dialing{done: make(chan struct{}), cancel: cancel}
	c.dial, c.id, c.recv = d, 0, 0
	c.frame, c.win, c.send = defaultMaxFrame, defaultWindow, defaultWindow
	c.enc = hpack.NewEncoder(&c.encb)
	c.dec = hpack.NewDecoder(4096, nil)
	go func() {
		defer close(d.done)
		conn, err := (&net.Dialer{}).DialContext(ctx, "unix", c.socket)
		if err == nil {
			// The preface and an empty SETTINGS frame open the connection.
			_, err = conn.Write(append([]byte(preface), appendFrame(nil, frameSettings, 0, 0, nil)...))
			if err != nil {
				conn.Close()
			}
		}
		d.conn, d.err = conn, err
	}()
	return d
}

// Close closes the connection (and stops a dial under way).
func (c *Conn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.drop()
}

func (c *Conn) drop() error {
	d := c.dial
	if d == nil {
		return nil
	}
	c.dial = nil
	d.cancel()
	<-d.done
	if d.conn != nil {
		return d.conn.Close()
	}
	return nil
}

// Call calls the unary method (a full method name,
// "/package.Service/Method") with the request message msg, encoded by the
// caller in the protobuf wire format, and returns the answer's message,
// still encoded. A call that the server answers with a non-OK status, or
// that fails, returns a *Status (see CodeOf).
func (c *Conn) Call(ctx context.Context, method string, msg []byte) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.startDial()
	select {
	case <-d.done:
	case <-ctx.Done():
		return nil, ctxStatus(ctx)
	}
	if d.err != nil {
		_ = c.drop()
		return nil, &Status{Code: Unavailable, Message: "connection error: " + d.err.Error()}
	}
	st, body := c.call(ctx, d.conn, method, msg)
	if st.Code != OK {
		return nil, st
	}
	return body, nil
}

// call runs one stream with ctx's deadline and cancellation on conn. A
// failure of the connection drops it, so that the next call dials again;
// a call the server answered keeps it (unless the server is going away).
func (c *Conn) call(ctx context.Context, conn net.Conn, method string, msg []byte) (*Status, []byte) {
	deadline, ok := ctx.Deadline()
	if ok && time.Until(deadline) <= 0 {
		return ctxStatus(ctx), nil
	}
	_ = conn.SetDeadline(deadline) // the zero time when ctx has none
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	st, body, goingAway, err := c.exchange(conn, method, msg, deadline)
	if stop() {
		_ = conn.SetDeadline(time.Time{})
	}
	if err == nil && !goingAway {
		return st, body
	}
	_ = c.drop()
	var failed *Status
	switch {
	case err == nil:
		return st, body
	case ctx.Err() != nil:
		return ctxStatus(ctx), nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		// The deadline set from ctx passed before ctx noticed.
		return &Status{Code: DeadlineExceeded, Message: context.DeadlineExceeded.Error()}, nil
	case errors.As(err, &failed):
		return failed, nil
	}
	return &Status{Code: Unavailable, Message: "connection error: " + err.Error()}, nil
}

// exchange writes the request stream and reads frames until the server ends
// it. It returns the server's status and the response message, whether the
// server sent GOAWAY, or the error that broke the connection: an I/O error,
// or a *Status for a stream the server reset or a protocol violation.
func (c *Conn) exchange(conn net.Conn, method string, msg []byte, deadline time.Time) (st *Status, body []byte, goingAway bool, err error) {
	n := int64(len(msg)) + 5
	if n > min(c.win, c.send) {
		// Requests are small (a pod's identity and timings); a bigger one
		// would have to wait for WINDOW_UPDATEs, which this client does not.
		return nil, nil, false, &Status{Code: ResourceExhausted, Message: fmt.Sprintf("request of %d bytes exceeds the HTTP/2 flow-control window", len(msg))}
	}
	c.send -= n
	c.id += 2
	if c.id == 2 {
		c.id = 1
	}
	id := c.id
	if _, err := conn.Write(c.request(id, method, msg, deadline)); err != nil {
		return nil, nil, false, err
	}
	var data []byte
	headersSeen := false
	for {
		typ, flags, sid, payload, err := c.readFrame(conn)
		if err != nil {
			return nil, nil, goingAway, err
		}
		switch typ {
		case frameSettings:
			if flags&flagAck == 0 {
				c.settings(payload)
				if _, err := conn.Write(appendFrame(nil, frameSettings, flagAck, 0, nil)); err != nil {
					return nil, nil, goingAway, err
				}
			}
		case framePing:
			if flags&flagAck == 0 {
				if _, err := conn.Write(appendFrame(nil, framePing, flagAck, 0, payload)); err != nil {
					return nil, nil, goingAway, err
				}
			}
		case frameWindowUpdate:
			if sid == 0 && len(payload) == 4 {
				c.send += int64(binary.BigEndian.Uint32(payload) & 0x7fffffff)
			}
		case frameGoAway:
			if len(payload) < 8 {
				return nil, nil, true, protocolError("short GOAWAY frame")
			}
			goingAway = true
			if binary.BigEndian.Uint32(payload)&0x7fffffff < id {
				return nil, nil, true, &Status{Code: Unavailable, Message: "the server is going away (GOAWAY)"}
			}
		case frameRSTStream:
			if sid == id {
				if len(payload) < 4 {
					return nil, nil, goingAway, protocolError("short RST_STREAM frame")
				}
				st := resetStatus(binary.BigEndian.Uint32(payload))
				if st.Code == Canceled && !deadline.IsZero() && !time.Now().Before(deadline) {
					// The server cancelled the stream because the deadline
					// (sent as grpc-timeout) passed: say so, as grpc-go does.
					st = &Status{Code: DeadlineExceeded, Message: context.DeadlineExceeded.Error()}
				}
				return nil, nil, goingAway, st
			}
		case frameData:
			if sid != id {
				continue
			}
			if payload, err = unpad(flags, payload); err != nil {
				return nil, nil, goingAway, err
			}
			if len(data)+len(payload) > maxResponse+5 {
				return nil, nil, goingAway, &Status{Code: ResourceExhausted, Message: fmt.Sprintf("response larger than %d bytes", maxResponse)}
			}
			data = append(data, payload...)
			if err := c.refill(conn, id, len(payload), flags&flagEndStream != 0); err != nil {
				return nil, nil, goingAway, err
			}
			if flags&flagEndStream != 0 {
				return nil, nil, goingAway, protocolError("stream ended without trailers")
			}
		case frameHeaders:
			fields, err := c.headerBlock(conn, flags, payload)
			if err != nil {
				return nil, nil, goingAway, err
			}
			if sid != id {
				continue
			}
			if !headersSeen {
				headersSeen = true
				if s := fields[":status"]; s != "200" {
					return nil, nil, goingAway, &Status{Code: httpStatusCode(s), Message: "unexpected HTTP status " + s}
				}
			}
			if flags&flagEndStream == 0 {
				continue
			}
			st, err := trailerStatus(fields)
			if err != nil {
				return nil, nil, goingAway, err
			}
			if st.Code != OK {
				return st, nil, goingAway, nil
			}
			body, err := message(data)
			return st, body, goingAway, err
		}
	}
}

// request encodes the HEADERS and DATA frames of one call.
func (c *Conn) request(id uint32, method string, msg []byte, deadline time.Time) []byte {
	c.encb.Reset()
	for _, f := range [][2]string{
		{":method", "POST"},
		{":scheme", "http"},
		{":path", method},
		{":authority", "localhost"},
		{"content-type", "application/grpc"},
		{"te", "trailers"},
		{"user-agent", "aether-cni grpcwire"},
	} {
		_ = c.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if !deadline.IsZero() {
		_ = c.enc.WriteField(hpack.HeaderField{Name: "grpc-timeout", Value: timeout(time.Until(deadline))})
	}
	b := appendFrame(nil, frameHeaders, flagEndHeaders, id, c.encb.Bytes())
	body := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg))) // not compressed, length
	body = append(body, msg...)
	for len(body) > int(c.frame) {
		b = appendFrame(b, frameData, 0, id, body[:c.frame])
		body = body[c.frame:]
	}
	return appendFrame(b, frameData, flagEndStream, id, body)
}

// readFrame reads one frame; its payload is valid until the next read.
func (c *Conn) readFrame(r io.Reader) (typ, flags byte, stream uint32, payload []byte, err error) {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, 0, nil, err
	}
	n := uint32(h[0])<<16 | uint32(h[1])<<8 | uint32(h[2])
	if n > maxResponse+defaultMaxFrame {
		return 0, 0, 0, nil, protocolError(fmt.Sprintf("frame of %d bytes", n))
	}
	if cap(c.rbuf) < int(n) {
		c.rbuf = make([]byte, n)
	}
	payload = c.rbuf[:n]
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, 0, 0, nil, err
	}
	return h[3], h[4], binary.BigEndian.Uint32(h[5:]) & 0x7fffffff, payload, nil
}

// headerBlock decodes a HEADERS frame and its CONTINUATION frames.
func (c *Conn) headerBlock(r io.Reader, flags byte, payload []byte) (map[string]string, error) {
	payload, err := unpad(flags, payload)
	if err != nil {
		return nil, err
	}
	if flags&flagPriority != 0 {
		if len(payload) < 5 {
			return nil, protocolError("short HEADERS frame")
		}
		payload = payload[5:]
	}
	block := append([]byte(nil), payload...)
	for flags&flagEndHeaders == 0 {
		var typ byte
		if typ, flags, _, payload, err = c.readFrame(r); err != nil {
			return nil, err
		}
		if typ != frameContinuation {
			return nil, protocolError("header block interrupted")
		}
		block = append(block, payload...)
	}
	fields, err := c.dec.DecodeFull(block)
	if err != nil {
		return nil, protocolError("bad header block: " + err.Error())
	}
	m := make(map[string]string, len(fields))
	for _, f := range fields {
		m[f.Name] = f.Value
	}
	return m, nil
}

// settings applies the server's SETTINGS this client depends on.
func (c *Conn) settings(p []byte) {
	for ; len(p) >= 6; p = p[6:] {
		v := binary.BigEndian.Uint32(p[2:])
		switch binary.BigEndian.Uint16(p) {
		case settingInitialWindowSize:
			c.win = int64(v)
		case settingMaxFrameSize:
			c.frame = v
		}
	}
}

// refill returns received DATA to the server's send windows (the
// connection's, and the stream's unless it ends) once enough accumulated.
func (c *Conn) refill(w io.Writer, id uint32, n int, ended bool) error {
	c.recv += n
	if c.recv < windowRefill {
		return nil
	}
	inc := binary.BigEndian.AppendUint32(nil, uint32(c.recv))
	b := appendFrame(nil, frameWindowUpdate, 0, 0, inc)
	if !ended {
		b = appendFrame(b, frameWindowUpdate, 0, id, inc)
	}
	c.recv = 0
	_, err := w.Write(b)
	return err
}

func appendFrame(b []byte, typ, flags byte, stream uint32, payload []byte) []byte {
	n := len(payload)
	b = append(b, byte(n>>16), byte(n>>8), byte(n), typ, flags)
	b = binary.BigEndian.AppendUint32(b, stream)
	return append(b, payload...)
}

func unpad(flags byte, p []byte) ([]byte, error) {
	if flags&flagPadded == 0 {
		return p, nil
	}
	if len(p) == 0 || int(p[0]) >= len(p) {
		return nil, protocolError("bad padding")
	}
	return p[1 : len(p)-int(p[0])], nil
}

// message takes the one length-prefixed message out of a response body.
func message(data []byte) ([]byte, error) {
	if len(data) < 5 {
		return nil, protocolError("response without a message")
	}
	if data[0] != 0 {
		return nil, protocolError("compressed response (none was accepted)")
	}
	n := binary.BigEndian.Uint32(data[1:])
	if uint64(n) != uint64(len(data)-5) {
		return nil, protocolError(fmt.Sprintf("response message of %d bytes in %d bytes of DATA", n, len(data)-5))
	}
	return data[5:], nil
}

// trailerStatus reads grpc-status and grpc-message.
func trailerStatus(fields map[string]string) (*Status, error) {
	s, ok := fields["grpc-status"]
	if !ok {
		return nil, protocolError("trailers without grpc-status")
	}
	code, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return nil, protocolError("bad grpc-status " + strconv.Quote(s))
	}
	msg := fields["grpc-message"]
	if m, err := url.PathUnescape(msg); err == nil {
		msg = m
	}
	return &Status{Code: Code(code), Message: msg}, nil
}

// timeout encodes d as a grpc-timeout value: at most 8 digits and a unit.
func timeout(d time.Duration) string {
	if d <= 0 {
		return "1n"
	}
	if ms := (d + time.Millisecond - 1) / time.Millisecond; ms <= 99999999 {
		return strconv.FormatInt(int64(ms), 10) + "m"
	}
	return strconv.FormatInt(int64((d+time.Second-1)/time.Second), 10) + "S"
}

func ctxStatus(ctx context.Context) *Status {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &Status{Code: DeadlineExceeded, Message: ctx.Err().Error()}
	}
	return &Status{Code: Canceled, Message: ctx.Err().Error()}
}

func protocolError(what string) *Status {
	return &Status{Code: Internal, Message: "HTTP/2 protocol error: " + what}
}
