package hbone

import (
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

// allow reports whether a line may go out now, and how many were held
// back since the last one that did.
func (l *logLimiter) allow() (suppressed uint64, ok bool) {
	now := time.Now().UnixNano()
	next := l.next.Load()
	if now < next || !l.next.CompareAndSwap(next, now+int64(logInterval)) {
		l.suppressed.Add(1)
		return 0, false
	}
	return l.suppressed.Swap(0), true
}
