package capturetest

import (
	"syscall"
	"testing"
	"time"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/sockcloser"
	"aether.io/node/pkg/sockcloser/sockclosertest"
)

// Closer is aether-cni's socket closer (capture.CloserName) that counts its
// starts, for tests and benchmarks that must know whether an install
// started it and leave no closer behind (End).
type Closer struct {
	*sockcloser.ExecCloser
	// Starts counts Start calls.
	Starts int
	ended  bool
	ws     syscall.WaitStatus
}

// NewCloser returns a Closer not started yet, living at most life (the
// default when zero).
func NewCloser(life time.Duration) *Closer {
	return &Closer{ExecCloser: &sockcloser.ExecCloser{Name: capture.CloserName, Life: life}}
}

// Start counts the start and starts the closer.
func (c *Closer) Start() {
	c.Starts++
	c.ExecCloser.Start()
}

// End does what the plugin's exit does, closing this process's end of the
// pair, and then reaps the closer, if it was started: it returns the
// closer's wait status, or started false when it never ran. Ending it again
// returns the same.
func (c *Closer) End(tb testing.TB) (ws syscall.WaitStatus, started bool) {
	tb.Helper()
	if c.Starts == 0 {
		return 0, false
	}
	if c.ended {
		return c.ws, true
	}
	pid, err := c.Started()
	if err != nil {
		tb.Fatalf("closer not started: %v", err)
	}
	if err := c.Close(); err != nil {
		tb.Fatal(err)
	}
	ws = sockclosertest.Reap(tb, pid)
	c.ended, c.ws = true, ws
	return ws, true
}
