package telemetry

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// AccessLogLevel selects the connections the access log writes.
type AccessLogLevel uint8

// Access log levels (-access-log).
const (
	// AccessLogOff writes nothing.
	AccessLogOff AccessLogLevel = iota
	// AccessLogErrors writes the connections that did not end cleanly
	// (refused, failed, reset, timed out, cut by a drain): CloseReason
	// other than client_closed and server_closed.
	AccessLogErrors
	// AccessLogAll writes every connection.
	AccessLogAll
)

// DefaultAccessLogLevel is the binary's default: errors only. A line per
// connection costs CPU on the data path and log volume in proportion to
// the connection rate, which the istio_tcp_* series already count; the
// lines an operator needs to find out why a connection failed are the
// error ones, and they are rare.
const DefaultAccessLogLevel = AccessLogErrors

// ParseAccessLogLevel parses off, errors or all.
func ParseAccessLogLevel(s string) (AccessLogLevel, error) {
	switch s {
	case "off":
		return AccessLogOff, nil
	case "errors":
		return AccessLogErrors, nil
	case "all":
		return AccessLogAll, nil
	}
	return AccessLogOff, fmt.Errorf("invalid access log level %q: use off, errors or all", s)
}

// String returns the level as -access-log spells it.
func (l AccessLogLevel) String() string {
	switch l {
	case AccessLogErrors:
		return "errors"
	case AccessLogAll:
		return "all"
	}
	return "off"
}

// The access log's keys: one JSON object per line, after slog's time,
// level and msg ("connection opened", "connection closed"), always every
// field of flowapi.Event under its JSON name, in its order (empty strings
// and zeros where a value is not known): newEvent builds it, eventAttrs
// turns it into the line's attributes, and the flows socket streams the
// same Event.

// Values of the access log's policy_decision.
const (
	// PolicyNone: no policy decided (none applies to the destination,
	// the source side, which does not enforce, or no authorization).
	PolicyNone = "none"
	// PolicyAllow: an ALLOW authorization policy (the line's policy)
	// matched.
	PolicyAllow = "allow"
	// PolicyDeny: the connection was refused by the policy the line's
	// policy names (an authorization policy, or a built-in rule); with
	// ALLOW policies of which none matched, policy is empty and
	// policy_reason says so.
	PolicyDeny = "deny"
)

// Policies that refuse connections today (the access log's policy).
const (
	// PolicyInboundStrict is a pod's inbound policy strict refusing
	// plaintext on its inbound listener.
	PolicyInboundStrict = "inbound-policy/strict"
	// PolicyDeclaredPortsOnly is -hbone-declared-ports-only refusing an
	// HBONE stream to a port the pod does not declare.
	PolicyDeclaredPortsOnly = "hbone-declared-ports-only"
)

// AccessLog writes one structured line per connection at its end and,
// optionally, one at its open. Lines are buffered (lineBuffer): written
// within FlushInterval, when FlushSize is held, and at Flush.
type AccessLog struct {
	log   *slog.Logger
	out   *lineBuffer
	level AccessLogLevel
	rate  float64
	opens bool
}

// FlushInterval and FlushSize bound how long and how much of the access log
// is held before it is written (a write(2) per line to a file cost the
// proxy ~5% more CPU per connection; Envoy's file access log buffers the
// same way, 1 s and 64 KiB by default). MaxHeld bounds what is held while a
// write is under way: a stdout that does not drain drops lines (counted),
// it never holds up a connection.
const (
	FlushInterval = 200 * time.Millisecond
	FlushSize     = 64 << 10
	MaxHeld       = 1 << 20
)

// lineBuffer holds whole lines (slog writes a record in one Write) for w.
// One write to w is under way at a time, outside the lock: lines keep
// being taken (up to MaxHeld) while it runs.
type lineBuffer struct {
	w io.Writer

	mu      sync.Mutex
	idle    *sync.Cond // signalled when a write ends
	buf     []byte
	spare   []byte
	writing bool
	timer   *time.Timer // flushes FlushInterval after the first held line
	armed   bool
	dropped atomic.Uint64
}

func newLineBuffer(w io.Writer) *lineBuffer {
	b := &lineBuffer{w: w}
	b.idle = sync.NewCond(&b.mu)
	return b
}

// Write holds p; it never fails (a broken or stuck stdout loses lines, not
// connections). Once FlushSize is held the lines are written on a
// goroutine of their own, so no connection waits for stdout.
func (b *lineBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.buf)+len(p) > MaxHeld {
		b.dropped.Add(1)
		return len(p), nil
	}
	b.buf = append(b.buf, p...)
	if len(b.buf) >= FlushSize && !b.writing {
		go b.write(b.takeLocked())
		return len(p), nil
	}
	b.armLocked()
	return len(p), nil
}

// armLocked starts the flush timer when lines are held, no write is under
// way (its end arms it) and it is not running.
func (b *lineBuffer) armLocked() {
	if b.armed || b.writing || len(b.buf) == 0 {
		return
	}
	b.armed = true
	if b.timer == nil {
		b.timer = time.AfterFunc(FlushInterval, b.tick)
	} else {
		b.timer.Reset(FlushInterval)
	}
}

// tick is the flush timer: it writes what is held (on the timer's
// goroutine).
func (b *lineBuffer) tick() {
	b.mu.Lock()
	b.armed = false
	if b.writing {
		b.mu.Unlock()
		return
	}
	out := b.takeLocked()
	b.mu.Unlock()
	b.write(out)
}

// takeLocked takes the held lines for a write, which the caller then does
// (write) with b.mu released.
func (b *lineBuffer) takeLocked() []byte {
	if b.armed {
		b.timer.Stop()
		b.armed = false
	}
	out := b.buf
	b.buf, b.spare = b.spare[:0], nil
	b.writing = true
	return out
}

// write writes out and ends the write: what came meanwhile waits for the
// timer, or the next FlushSize.
func (b *lineBuffer) write(out []byte) {
	if len(out) > 0 {
		_, _ = b.w.Write(out)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.writing = false
	if cap(out) <= 4*FlushSize { // a burst's buffer is not kept
		b.spare = out[:0]
	}
	b.armLocked()
	b.idle.Broadcast()
}

// flush writes everything held now, after the write under way, if any.
func (b *lineBuffer) flush() {
	b.mu.Lock()
	for b.writing {
		b.idle.Wait()
	}
	out := b.takeLocked()
	b.mu.Unlock()
	b.write(out)
}

// Flush writes the lines held now (at the proxy's stop). A nil AccessLog
// holds none.
func (a *AccessLog) Flush() {
	if a != nil {
		a.out.flush()
	}
}

// Dropped is the number of lines dropped because MaxHeld was held while a
// write did not end (stdout not drained).
func (a *AccessLog) Dropped() uint64 {
	if a == nil {
		return 0
	}
	return a.out.dropped.Load()
}

// NewAccessLog returns the access log writing JSON lines to w (the proxy's
// stdout): at level, keeping each connection's lines with probability rate
// (0..1; 1 keeps all), and with opens (level all only) a line when a
// connection opens too. Level off or rate 0 returns nil, which writes
// nothing.
func NewAccessLog(w io.Writer, level AccessLogLevel, rate float64, opens bool) (*AccessLog, error) {
	if rate < 0 || rate > 1 || rate != rate {
		return nil, fmt.Errorf("invalid access log sample rate %v: must be between 0 and 1", rate)
	}
	if level == AccessLogOff || rate == 0 {
		return nil, nil
	}
	out := newLineBuffer(w)
	return &AccessLog{log: slog.New(slog.NewJSONHandler(out, nil)), out: out, level: level, rate: rate, opens: opens && level == AccessLogAll}, nil
}

// sample decides whether a new connection's lines are kept (rate). A nil
// AccessLog keeps none.
func (a *AccessLog) sample() bool {
	return a != nil && (a.rate >= 1 || rand.Float64() < a.rate)
}

// opened writes the open line of a sampled connection when opens is set.
func (a *AccessLog) opened(i *ConnInfo, start time.Time) {
	if a == nil || !a.opens {
		return
	}
	ev := newEvent(i, start, time.Time{}, 0, 0, reasonNone, nil)
	a.log.LogAttrs(context.Background(), slog.LevelInfo, "connection opened", eventAttrs(&ev)...)
}

// write writes the close line of a sampled connection, when the level
// keeps it. A nil AccessLog writes nothing.
func (a *AccessLog) write(i *ConnInfo, start, end time.Time, toDst, toSrc int64, reason CloseReason, err error) {
	if a == nil || (a.level == AccessLogErrors && reason.Clean()) {
		return
	}
	lvl := slog.LevelInfo
	if !reason.Clean() {
		lvl = slog.LevelWarn
	}
	ev := newEvent(i, start, end, toDst, toSrc, reason, err)
	a.log.LogAttrs(context.Background(), lvl, "connection closed", eventAttrs(&ev)...)
}
