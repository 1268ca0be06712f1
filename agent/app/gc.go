package app

import (
	"os"
	"runtime/debug"
)

// DefaultGCPercent is --gc-percent's default. The agent keeps every pod's
// record, endpoint and listeners in memory, a heap of a few MB on a node:
// at Go's default of 100 a burst of AddPods ran a collection every few
// hundred calls, and each one's concurrent mark (a CPU of two, plus
// assists) made the slowest AddPods (agent/README.md, 'AddPod cost').
// At 400 the heap may reach five times what is live (at least 16 MB)
// before a collection.
const DefaultGCPercent = 400

// applyGCPercent sets the GC target percentage to percent unless the GOGC
// environment variable is set (the operator's choice wins). It returns
// the percentage in effect.
func applyGCPercent(percent int) int {
	if os.Getenv("GOGC") != "" {
		prev := debug.SetGCPercent(percent)
		debug.SetGCPercent(prev)
		return prev
	}
	debug.SetGCPercent(percent)
	return percent
}
