package app

import (
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
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

// memoryLimitShare is the part of the container's memory limit the agent
// sets as the Go runtime's soft memory limit when GOMEMLIMIT is not set: the
// headroom DefaultGCPercent allows (five times the live heap) never pushes
// the process into the container's OOM kill; near the limit the GC just
// collects more often.
const memoryLimitShare = 0.75

// applyMemoryLimit sets the runtime's soft memory limit to memoryLimitShare
// of the memory limit of the cgroup the process runs in, read under root
// (/sys/fs/cgroup) for the cgroup /proc/self/cgroup names, unless the
// GOMEMLIMIT environment variable is set (the operator's choice wins). It
// returns the limit it set, 0 when it set none (GOMEMLIMIT set, no
// cgroup limit, or none readable).
func applyMemoryLimit(root string, self []byte) int64 {
	if os.Getenv("GOMEMLIMIT") != "" {
		return 0
	}
	limit := cgroupMemoryLimit(root, self)
	if limit <= 0 {
		return 0
	}
	soft := int64(float64(limit) * memoryLimitShare)
	debug.SetMemoryLimit(soft)
	return soft
}

// cgroupMemoryLimit is the memory limit in bytes of the cgroup that self
// (the contents of /proc/self/cgroup) names, under root: cgroup v2's
// memory.max, else v1's memory.limit_in_bytes; each at the process's own
// cgroup path, then at the root of the mount (a container with its own
// cgroup namespace sees its cgroup there). 0 when unlimited or unknown.
func cgroupMemoryLimit(root string, self []byte) int64 {
	var v2, v1 string
	for _, line := range strings.Split(string(self), "\n") {
		id, rest, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		controllers, path, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		if id == "0" && controllers == "" {
			v2 = path
		}
		if slices.Contains(strings.Split(controllers, ","), "memory") {
			v1 = path
		}
	}
	var candidates []string
	if v2 != "" {
		candidates = append(candidates, filepath.Join(root, v2, "memory.max"), filepath.Join(root, "memory.max"))
	}
	if v1 != "" {
		candidates = append(candidates, filepath.Join(root, "memory", v1, "memory.limit_in_bytes"), filepath.Join(root, "memory", "memory.limit_in_bytes"))
	}
	for _, p := range candidates {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			return 0
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n <= 0 || n >= math.MaxInt64/2 { // v1 reports "unlimited" as a huge page-rounded number
			return 0
		}
		return n
	}
	return 0
}
