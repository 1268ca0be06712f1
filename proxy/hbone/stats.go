package hbone

import "sync/atomic"

// ServerStats is a snapshot of a Server's counters, for the proxy's telemetry.
type ServerStats struct {
	// Accepted counts TCP connections accepted on the listener.
	Accepted uint64
	// Handshakes counts completed mTLS handshakes (peer SVID verified, ALPN h2).
	Handshakes uint64
	// HandshakeTimeouts counts connections closed because the handshake did
	// not finish within HandshakeTimeout.
	HandshakeTimeouts uint64
	// HandshakeFailures counts other failed handshakes: no or untrusted client
	// SVID, expired certificate, no local SVID, no ALPN h2.
	HandshakeFailures uint64
	// StreamsOpened counts CONNECT streams delivered (200 sent).
	StreamsOpened uint64
	// StreamsActive is the number of CONNECT streams being served now.
	StreamsActive int64
	// StreamsBadRequest counts streams refused before delivery: not CONNECT
	// (405) or an authority that is not ip:port (400).
	StreamsBadRequest uint64
	// StreamsDeliverFailed counts streams whose Deliver callback failed (503,
	// or the code of a StatusError).
	StreamsDeliverFailed uint64
	// ControlFloods counts connections closed because their client did not
	// read the control frames it asked for (PING/SETTINGS acks, resets)
	// while more than 1 MiB of them were queued, or more than the Budget's
	// Control had room for.
	ControlFloods uint64
	// ConnsRejected counts connections closed at accept because the
	// Budget's connection cap (node or source) was reached.
	ConnsRejected uint64
	// WriteTimeouts counts connections closed because a write to the
	// client did not finish within WriteTimeout.
	WriteTimeouts uint64
	// PingTimeouts counts connections closed because the client did not
	// acknowledge a PING within PingTimeout.
	PingTimeouts uint64
	// ProtocolErrors counts connections closed on a connection error of
	// the client's (GOAWAY with its code: a malformed frame, flow control,
	// over 100 SETTINGS entries, a header block over 144 KiB).
	ProtocolErrors uint64
}

// DialerStats is a snapshot of a Dialer's counters, for the proxy's telemetry.
type DialerStats struct {
	// ConnsOpened counts pooled HTTP/2 connections established (mTLS done).
	ConnsOpened uint64
	// ConnsFailed counts connection attempts that failed (dial or handshake).
	ConnsFailed uint64
	// ConnsEvicted counts pooled connections removed because they broke or
	// were closed by the peer (GOAWAY).
	ConnsEvicted uint64
	// ConnsPooled is the number of connections in the pool now.
	ConnsPooled int64
	// StreamsOpened counts CONNECT streams that got a 200.
	StreamsOpened uint64
	// StreamsFailed counts CONNECT streams that failed (transport error or a
	// status other than 200).
	StreamsFailed uint64
	// ControlFloods counts connections closed because their server did not
	// read the control frames it asked for (PING/SETTINGS acks) while more
	// than 1 MiB of them were queued, or more than the Budget's Control had
	// room for.
	ControlFloods uint64
	// WriteTimeouts counts connections closed because a write to the
	// server did not finish within WriteTimeout.
	WriteTimeouts uint64
	// PingTimeouts counts connections closed because the server did not
	// acknowledge a PING within PingTimeout.
	PingTimeouts uint64
	// ProtocolErrors counts connections closed on a connection error of
	// the server's (GOAWAY with its code: a malformed frame, flow control,
	// over 100 SETTINGS entries, a header block over 144 KiB).
	ProtocolErrors uint64
}

type serverCounters struct {
	h2Counters                                                 // the engine's, per reason a connection closed
	accepted, handshakes, handshakeTimeouts, handshakeFailures atomic.Uint64
	streamsOpened, streamsBadRequest, streamsDeliverFailed     atomic.Uint64
	connsRejected                                              atomic.Uint64
	streamsActive                                              atomic.Int64
}

func (c *serverCounters) snapshot() ServerStats {
	return ServerStats{
		Accepted:             c.accepted.Load(),
		Handshakes:           c.handshakes.Load(),
		HandshakeTimeouts:    c.handshakeTimeouts.Load(),
		HandshakeFailures:    c.handshakeFailures.Load(),
		StreamsOpened:        c.streamsOpened.Load(),
		StreamsActive:        c.streamsActive.Load(),
		StreamsBadRequest:    c.streamsBadRequest.Load(),
		StreamsDeliverFailed: c.streamsDeliverFailed.Load(),
		ControlFloods:        c.controlFloods.Load(),
		ConnsRejected:        c.connsRejected.Load(),
		WriteTimeouts:        c.writeTimeouts.Load(),
		PingTimeouts:         c.pingTimeouts.Load(),
		ProtocolErrors:       c.protocolErrors.Load(),
	}
}

type dialerCounters struct {
	h2Counters                                                           // the engine's, per reason a connection closed
	connsOpened, connsFailed, connsEvicted, streamsOpened, streamsFailed atomic.Uint64
	connsPooled                                                          atomic.Int64
}

func (c *dialerCounters) snapshot() DialerStats {
	return DialerStats{
		ConnsOpened:    c.connsOpened.Load(),
		ConnsFailed:    c.connsFailed.Load(),
		ConnsEvicted:   c.connsEvicted.Load(),
		ConnsPooled:    c.connsPooled.Load(),
		StreamsOpened:  c.streamsOpened.Load(),
		StreamsFailed:  c.streamsFailed.Load(),
		ControlFloods:  c.controlFloods.Load(),
		WriteTimeouts:  c.writeTimeouts.Load(),
		PingTimeouts:   c.pingTimeouts.Load(),
		ProtocolErrors: c.protocolErrors.Load(),
	}
}
