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
	"strconv"
	"strings"
	"time"

	"aether.io/node/meshcni/internal/grpcwire"
	"aether.io/node/meshcni/internal/pbwire"
)

// FromNetnsPath returns the PID a netns path names, if it names one:
// /proc/<pid>/ns/net or /proc/<pid>/task/<tid>/ns/net. (Parsed by hand: a
// package-level regexp is compiled at every plugin start.)
func FromNetnsPath(path string) (uint32, bool) {
	rest, ok := strings.CutPrefix(path, "/proc/")
	if !ok {
		return 0, false
	}
	pidText, rest, ok := strings.Cut(rest, "/")
	if !ok || !decimal(pidText) {
		return 0, false
	}
	if task, ok := strings.CutPrefix(rest, "task/"); ok {
		tid, after, ok := strings.Cut(task, "/")
		if !ok || !decimal(tid) {
			return 0, false
		}
		rest = after
	}
	if rest != "ns/net" {
		return 0, false
	}
	pid, err := strconv.ParseUint(pidText, 10, 32)
	if err != nil || pid == 0 {
		return 0, false
	}
	return uint32(pid), true
}

// decimal reports whether s is one or more ASCII digits.
func decimal(s string) bool {
	if s == "" {
		return false
	}
	for i := range len(s) {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
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
	conn := grpcwire.New(path)
	defer func() { _ = conn.Close() }()
	req, err := wireCodec{}.Marshal(&statusRequest{sandboxID: sandboxID, verbose: true})
	if err != nil {
		return 0, err
	}
	b, err := conn.Call(ctx, podSandboxStatusMethod, req)
	if err != nil {
		return 0, fmt.Errorf("failed to get sandbox status of %q: %w", sandboxID, err)
	}
	var resp statusResponse
	if err := (wireCodec{}).Unmarshal(b, &resp); err != nil {
		return 0, err
	}
	return pidFromInfo(resp.info)
}

// The one CRI call the plugin makes, encoded by hand: linking
// k8s.io/cri-api would register its whole descriptor at every plugin start
// (see meshcni/README.md, "Start-up"). Field numbers are those of
// k8s.io/cri-api/pkg/apis/runtime/v1/api.proto; the tests serve the real
// generated RuntimeService.
const podSandboxStatusMethod = "/runtime.v1.RuntimeService/PodSandboxStatus"

// statusRequest is PodSandboxStatusRequest{pod_sandbox_id = 1, verbose = 2}.
type statusRequest struct {
	sandboxID string
	verbose   bool
}

// statusResponse keeps PodSandboxStatusResponse's info map (field 2).
type statusResponse struct {
	info map[string]string
}

// wireCodec marshals statusRequest and unmarshals statusResponse in the
// protobuf wire format; the call goes through meshcni/internal/grpcwire
// (grpc-go would cost every plugin start its package init).
type wireCodec struct{}

func (wireCodec) Marshal(v any) ([]byte, error) {
	r, ok := v.(*statusRequest)
	if !ok {
		return nil, fmt.Errorf("failed to marshal CRI request: unexpected type %T", v)
	}
	b := pbwire.AppendBytesField(nil, 1, r.sandboxID)
	return pbwire.AppendBool(b, 2, r.verbose), nil
}

func (wireCodec) Unmarshal(data []byte, v any) error {
	r, ok := v.(*statusResponse)
	if !ok {
		return fmt.Errorf("failed to unmarshal CRI response: unexpected type %T", v)
	}
	r.info = map[string]string{}
	err := pbwire.Decode(data, func(f pbwire.Field) error {
		if f.Num != 2 {
			return nil
		}
		return f.StringMapEntry(&r.info)
	})
	if err != nil {
		return fmt.Errorf("failed to decode CRI response: %w", err)
	}
	return nil
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
