package dataplane

import (
	"testing"
	"time"
)

// TestRefusalLog: the first refusal of each port gets a line, at most one
// line per refusalLogInterval (held-back refusals reported with the next
// line), a port already logged never again, and no more than
// maxLoggedPorts ports per pod. Times are given, not read from the clock.
func TestRefusalLog(t *testing.T) {
	var r refusalLog
	t0 := time.Unix(1000, 0)
	step := func(port uint16, at time.Time, wantOK bool, wantSuppressed uint64) {
		t.Helper()
		ok, n := r.allow(port, at)
		if ok != wantOK || n != wantSuppressed {
			t.Fatalf("allow(%d, t0+%v) = %v, %d; want %v, %d", port, at.Sub(t0), ok, n, wantOK, wantSuppressed)
		}
	}
	step(80, t0, true, 0)
	step(80, t0.Add(time.Hour), false, 0) // once per port
	step(81, t0, false, 0)                // within the interval: held back
	step(82, t0.Add(refusalLogInterval/2), false, 0)
	step(81, t0.Add(refusalLogInterval), true, 2) // reports the two held back
	step(82, t0.Add(refusalLogInterval), false, 0)
	step(82, t0.Add(2*refusalLogInterval), true, 1)

	at := t0.Add(3 * refusalLogInterval)
	for port := uint16(1000); len(r.logged) < maxLoggedPorts; port++ {
		step(port, at, true, 0)
		at = at.Add(refusalLogInterval)
	}
	step(2000, at.Add(time.Hour), false, 0) // full: only the metric counts
	if len(r.logged) != maxLoggedPorts {
		t.Fatalf("remembers %d ports, want at most %d", len(r.logged), maxLoggedPorts)
	}
}
