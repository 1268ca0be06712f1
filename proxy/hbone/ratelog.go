package hbone

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"
)

// logInterval is the least time between two lines of one logLimiter.
const logInterval = time.Second

// logLimiter rate-limits a log line a peer can cause at will (a refused
// connection, a failed delivery): one line per logInterval, with the count
// of the lines held back since the last one (key "suppressed").
type logLimiter struct {
	next       atomic.Int64 // unix nanoseconds before which lines are held back
	suppressed atomic.Uint64
}

// log writes msg at level unless a line went out less than logInterval ago.
func (l *logLimiter) log(lg *slog.Logger, level slog.Level, msg string, args ...any) {
	if !lg.Enabled(context.Background(), level) {
		return
	}
	now := time.Now().UnixNano()
	next := l.next.Load()
	if now < next || !l.next.CompareAndSwap(next, now+int64(logInterval)) {
		l.suppressed.Add(1)
		return
	}
	if n := l.suppressed.Swap(0); n > 0 {
		args = append(args, "suppressed", n)
	}
	lg.Log(context.Background(), level, msg, args...)
}
