// Package agentclient is aether-cni's client of aether-agent's CNIService on
// a unix socket: bounded deadlines on every call, bounded retries with
// backoff for AddPod (and RemovePod) on Unavailable and DeadlineExceeded
// only, and typed outcomes the plugin maps to CNI error codes.
//
// It speaks gRPC through meshcni/internal/grpcwire, not grpc-go: the plugin is
// exec'd per pod and verb, and grpc-go's packages cost every exec more than
// its calls (meshcni/README.md, "Start-up"). For the same reason its
// messages are plain Go types (messages.go) encoded and decoded by hand
// (wire.go), not the generated aether.cni.v1 ones: the plugin links no
// protobuf runtime. Its tests run it against a grpc-go server.
package agentclient

import (
	"context"
	"errors"
	"fmt"
	"time"

	"aether.io/node/meshcni/internal/grpcwire"
)

// The full method names of aether.cni.v1.CNIService (cni_service.proto;
// cniv1grpc has them too, but importing it links grpc-go).
const (
	MethodAddPod          = "/aether.cni.v1.CNIService/AddPod"
	MethodRemovePod       = "/aether.cni.v1.CNIService/RemovePod"
	MethodReportAddResult = "/aether.cni.v1.CNIService/ReportAddResult"
	MethodGetPod          = "/aether.cni.v1.CNIService/GetPod"
)

// ErrUnavailable marks an agent that did not answer (socket missing, not
// listening, or every attempt timed out): the plugin returns code 11.
var ErrUnavailable = errors.New("aether-agent unavailable")

// ErrNotFound is GetPod's answer for a container the agent holds no record of.
var ErrNotFound = errors.New("no agent record")

// Options bound the client's calls.
type Options struct {
	// Timeout bounds one attempt of an RPC.
	Timeout time.Duration
	// Attempts is how many times AddPod and RemovePod are tried.
	Attempts int
	// Backoff is the first pause between attempts; it doubles.
	Backoff time.Duration
	// ReportTimeout bounds ReportAddResult (a single attempt).
	ReportTimeout time.Duration
}

// Client talks to one agent socket over one connection, made by Connect or
// lazily by the first call (and again by the call after one that broke it).
type Client struct {
	socket string
	conn   *grpcwire.Conn
	opts   Options
}

// New returns a client of the agent at socket (no I/O happens here).
func New(socket string, opts Options) (*Client, error) {
	if opts.Attempts < 1 {
		opts.Attempts = 1
	}
	if opts.Backoff <= 0 {
		opts.Backoff = 100 * time.Millisecond
	}
	return &Client{socket: socket, conn: grpcwire.New(socket), opts: opts}, nil
}

// Connect starts connecting in the background (the first call would
// otherwise connect); it returns at once.
func (c *Client) Connect() { c.conn.Connect() }

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

func retryable(err error) bool {
	switch grpcwire.CodeOf(err) {
	case grpcwire.Unavailable, grpcwire.DeadlineExceeded:
		return true
	}
	return false
}

func (c *Client) unavailable(rpc string, err error) error {
	return fmt.Errorf("%w: %s on %s: %s; is aether-agent running and agent_socket right?", ErrUnavailable, rpc, c.socket, grpcwire.MessageOf(err))
}

// retry runs call up to Attempts times while it fails with Unavailable or
// DeadlineExceeded, each attempt bounded by Timeout, pausing Backoff (then
// doubled) between attempts; ctx bounds the whole.
func (c *Client) retry(ctx context.Context, rpc string, attempts int, call func(context.Context) error) error {
	backoff := c.opts.Backoff
	var err error
	for i := range attempts {
		actx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
		err = call(actx)
		cancel()
		if err == nil || !retryable(err) {
			return err
		}
		if i == attempts-1 {
			break
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return c.unavailable(rpc, err)
		case <-t.C:
		}
		backoff *= 2
	}
	return c.unavailable(rpc, err)
}

// AddPod sends req (the pod and, from a current plugin, its timings) and
// returns the agent's verdict.
func (c *Client) AddPod(ctx context.Context, req *AddPodRequest) (AddResult, error) {
	var res AddResult
	err := c.retry(ctx, "AddPod", c.opts.Attempts, func(ctx context.Context) error {
		r, err := c.callResult(ctx, MethodAddPod, marshalAddPod(req))
		res = AddResult(r)
		return err
	})
	if err != nil && !errors.Is(err, ErrUnavailable) {
		var ns, name string
		if req.Pod != nil {
			ns, name = req.Pod.Namespace, req.Pod.Name
		}
		return 0, fmt.Errorf("failed to add pod %s/%s: agent answered %s: %s", ns, name, grpcwire.CodeOf(err), grpcwire.MessageOf(err))
	}
	return res, err
}

// RemovePod withdraws the container of req (with the DEL's timings, from
// a current plugin) and returns the agent's verdict.
func (c *Client) RemovePod(ctx context.Context, req *RemovePodRequest) (RemoveResult, error) {
	var res RemoveResult
	err := c.retry(ctx, "RemovePod", c.opts.Attempts, func(ctx context.Context) error {
		r, err := c.callResult(ctx, MethodRemovePod, marshalRemovePod(req))
		res = RemoveResult(r)
		return err
	})
	if err != nil && !errors.Is(err, ErrUnavailable) {
		return 0, fmt.Errorf("failed to remove pod %s/%s: agent answered %s: %s", req.Namespace, req.Name, grpcwire.CodeOf(err), grpcwire.MessageOf(err))
	}
	return res, err
}

// ReportAddResult sends the ADD's timings, once, within ReportTimeout. An
// agent that predates the RPC (Unimplemented) is not an error.
func (c *Client) ReportAddResult(ctx context.Context, req *ReportRequest) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.ReportTimeout)
	defer cancel()
	// The answer is empty; only its status matters.
	_, err := c.conn.Call(ctx, MethodReportAddResult, marshalReport(req))
	if err == nil || grpcwire.CodeOf(err) == grpcwire.Unimplemented {
		return nil
	}
	return fmt.Errorf("failed to report add result of %q: %s: %s", req.ContainerID, grpcwire.CodeOf(err), grpcwire.MessageOf(err))
}

// call calls method with the encoded request msg and hands the answer to
// decode; an answer decode rejects is an Internal status.
func (c *Client) call(ctx context.Context, method string, msg []byte, decode func([]byte) error) error {
	body, err := c.conn.Call(ctx, method, msg)
	if err != nil {
		return err
	}
	if err := decode(body); err != nil {
		return &grpcwire.Status{Code: grpcwire.Internal, Message: "failed to unmarshal response: " + err.Error()}
	}
	return nil
}

// callResult calls method with the encoded request msg and decodes the
// answer's result field (AddPodResponse and RemovePodResponse).
func (c *Client) callResult(ctx context.Context, method string, msg []byte) (int32, error) {
	var r int32
	err := c.call(ctx, method, msg, func(b []byte) (err error) {
		r, err = resultField(b)
		return err
	})
	return r, err
}

// GetPod reads the agent's record of a container; ErrNotFound when none.
func (c *Client) GetPod(ctx context.Context, containerID string) (*Record, error) {
	var out *Record
	err := c.retry(ctx, "GetPod", 1, func(ctx context.Context) error {
		return c.call(ctx, MethodGetPod, marshalGetPod(containerID), func(b []byte) (err error) {
			out, err = unmarshalRecord(b)
			return err
		})
	})
	switch {
	case err == nil:
		return out, nil
	case grpcwire.CodeOf(err) == grpcwire.NotFound:
		return nil, fmt.Errorf("container %q: %w", containerID, ErrNotFound)
	case errors.Is(err, ErrUnavailable):
		return nil, err
	}
	return nil, fmt.Errorf("failed to get pod %q: agent answered %s: %s", containerID, grpcwire.CodeOf(err), grpcwire.MessageOf(err))
}

// Ready confirms the agent serves CNIService: a GetPod of a container that
// cannot exist must come back (NOT_FOUND or a record) within Timeout.
func (c *Client) Ready(ctx context.Context) error {
	_, err := c.GetPod(ctx, "aether-cni-status-probe")
	if err == nil || errors.Is(err, ErrNotFound) {
		return nil
	}
	return err
}
