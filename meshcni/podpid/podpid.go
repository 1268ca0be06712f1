// Package podpid finds a pod sandbox's process ID: from the netns path when
// it names a process (/proc/<pid>/ns/net), else with one bounded CRI
// PodSandboxStatus call. Under containerd the sandbox is not listed yet
// during ADD, so "no PID" is the normal outcome and never an error that
// fails the ADD.
package podpid

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

var procNetns = regexp.MustCompile(`^/proc/([0-9]+)/(?:task/[0-9]+/)?ns/net$`)

// FromNetnsPath returns the PID a netns path names, if it names one.
func FromNetnsPath(path string) (uint32, bool) {
	m := procNetns.FindStringSubmatch(path)
	if m == nil {
		return 0, false
	}
	pid, err := strconv.ParseUint(m[1], 10, 32)
	if err != nil || pid == 0 {
		return 0, false
	}
	return uint32(pid), true
}

// ErrNoPID means the runtime reported no PID for the sandbox (yet).
var ErrNoPID = errors.New("no sandbox pid")

// CRI looks sandbox PIDs up over a CRI runtime socket.
type CRI struct {
	// Timeout bounds the whole lookup (dial included).
	Timeout time.Duration
}

// Lookup asks the runtime at endpoint (unix:///path) for sandboxID's PID.
// A missing socket fails at once, without dialing.
func (c CRI) Lookup(ctx context.Context, endpoint, sandboxID string) (uint32, error) {
	path, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok {
		return 0, fmt.Errorf("invalid CRI endpoint %q: want unix:///path", endpoint)
	}
	if _, err := os.Stat(path); err != nil {
		return 0, fmt.Errorf("failed to find CRI socket %q: %w", path, err)
	}
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, fmt.Errorf("failed to create CRI client for %q: %w", endpoint, err)
	}
	defer func() { _ = conn.Close() }()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sandboxID, Verbose: true})
	if err != nil {
		return 0, fmt.Errorf("failed to get sandbox status of %q: %w", sandboxID, err)
	}
	return pidFromInfo(resp.GetInfo())
}

// pidFromInfo reads the pid from the verbose info: containerd puts a JSON
// document under "info" with a top-level "pid"; some runtimes put "pid".
func pidFromInfo(info map[string]string) (uint32, error) {
	if s, ok := info["pid"]; ok {
		if v, err := strconv.ParseUint(s, 10, 32); err == nil && v > 0 {
			return uint32(v), nil
		}
	}
	if s, ok := info["info"]; ok {
		var doc struct {
			Pid uint32 `json:"pid"`
		}
		if err := json.Unmarshal([]byte(s), &doc); err == nil && doc.Pid > 0 {
			return doc.Pid, nil
		}
	}
	return 0, ErrNoPID
}
