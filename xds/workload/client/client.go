// Package client is a delta xDS client of istio.workload.Workload: it
// subscribes (wildcard or by uid), ACKs or NACKs every response, keeps the
// resulting state and can resume with initial_resource_versions. It works
// against any server of the type URL, not only ours.
package client

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"aether.io/node/api/istio/workload"
)

// TypeURL is the type the client subscribes to.
const TypeURL = "type.googleapis.com/istio.workload.Workload"

// Options say where and what to subscribe.
type Options struct {
	// Socket is the server's unix socket path; Address a host:port. Exactly
	// one must be set.
	Socket, Address string
	// NodeID identifies the client to the server (default "aetherctl").
	NodeID string
	// Names are the uids to subscribe to; empty subscribes to everything.
	Names []string
	// InitialVersions are the versions the client already has (from an
	// earlier stream): the server sends only what differs.
	InitialVersions map[string]string
	// MaxMessageBytes bounds a received response; 0 means 1 GiB.
	MaxMessageBytes int
}

// Update is what one response changed.
type Update struct {
	// Updated are the workloads added or changed, in response order.
	Updated []*workload.Workload
	// Removed are the uids removed.
	Removed []string
	// Nonce is the response nonce.
	Nonce string
}

// Client is one delta ADS stream.
type Client struct {
	conn   *grpc.ClientConn
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc

	mu       sync.Mutex
	state    map[string]*workload.Workload
	versions map[string]string
}

// Target returns the gRPC target for opts.
func Target(opts Options) (string, error) {
	switch {
	case opts.Socket != "" && opts.Address != "":
		return "", errors.New("invalid xds client options: set either a socket or an address, not both")
	case opts.Socket != "":
		return "unix://" + opts.Socket, nil
	case opts.Address != "":
		return opts.Address, nil
	default:
		return "", errors.New("invalid xds client options: set a socket or an address")
	}
}

// Dial opens the stream and sends the subscription. The first response is
// read with Recv.
func Dial(ctx context.Context, opts Options) (*Client, error) {
	target, err := Target(opts)
	if err != nil {
		return nil, err
	}
	maxMsg := opts.MaxMessageBytes
	if maxMsg <= 0 {
		maxMsg = 1 << 30
	}
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg)))
	if err != nil {
		return nil, fmt.Errorf("failed to create xds client for %q: %w", target, err)
	}
	c, err := Open(ctx, conn, opts)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	c.conn = conn
	return c, nil
}

// Open opens the stream on an existing connection (Socket and Address are
// ignored). Close does not close conn.
func Open(ctx context.Context, conn grpc.ClientConnInterface, opts Options) (*Client, error) {
	sctx, cancel := context.WithCancel(ctx)
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(sctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("failed to open delta xds stream: %w", err)
	}
	node := opts.NodeID
	if node == "" {
		node = "aetherctl"
	}
	names := opts.Names
	if len(names) == 0 {
		names = []string{"*"}
	}
	req := &discovery.DeltaDiscoveryRequest{
		Node:                    &core.Node{Id: node},
		TypeUrl:                 TypeURL,
		ResourceNamesSubscribe:  names,
		InitialResourceVersions: opts.InitialVersions,
	}
	if err := stream.Send(req); err != nil {
		cancel()
		return nil, fmt.Errorf("failed to send delta xds subscription: %w", err)
	}
	return &Client{
		stream: stream, cancel: cancel,
		state:    make(map[string]*workload.Workload),
		versions: make(map[string]string),
	}, nil
}

// Recv waits for the next response, applies it to the state and ACKs it. A
// response that does not decode is NACKed, leaves the state alone and is
// returned as an error.
func (c *Client) Recv() (*Update, error) {
	resp, err := c.stream.Recv()
	if err != nil {
		return nil, fmt.Errorf("failed to receive delta xds response: %w", err)
	}
	up, derr := decode(resp)
	ack := &discovery.DeltaDiscoveryRequest{TypeUrl: TypeURL, ResponseNonce: resp.GetNonce()}
	if derr != nil {
		ack.ErrorDetail = &status.Status{Code: 3, Message: derr.Error()}
	}
	if err := c.stream.Send(ack); err != nil {
		return nil, fmt.Errorf("failed to acknowledge delta xds response %q: %w", resp.GetNonce(), err)
	}
	if derr != nil {
		return nil, derr
	}
	c.mu.Lock()
	for i, w := range up.Updated {
		c.state[w.GetUid()] = w
		c.versions[w.GetUid()] = resp.GetResources()[i].GetVersion()
	}
	for _, n := range up.Removed {
		delete(c.state, n)
		delete(c.versions, n)
	}
	c.mu.Unlock()
	return up, nil
}

func decode(resp *discovery.DeltaDiscoveryResponse) (*Update, error) {
	if resp.GetTypeUrl() != TypeURL {
		return nil, fmt.Errorf("unexpected type %q in response, want %q", resp.GetTypeUrl(), TypeURL)
	}
	up := &Update{Nonce: resp.GetNonce(), Removed: resp.GetRemovedResources()}
	for _, r := range resp.GetResources() {
		a := r.GetResource()
		if a.GetTypeUrl() != TypeURL {
			return nil, fmt.Errorf("resource %q has type %q, want %q", r.GetName(), a.GetTypeUrl(), TypeURL)
		}
		w := &workload.Workload{}
		if err := proto.Unmarshal(a.GetValue(), w); err != nil {
			return nil, fmt.Errorf("failed to decode workload %q: %w", r.GetName(), err)
		}
		if w.GetUid() != r.GetName() {
			return nil, fmt.Errorf("resource name %q differs from its uid %q", r.GetName(), w.GetUid())
		}
		up.Updated = append(up.Updated, w)
	}
	return up, nil
}

// Subscribe adds (and Unsubscribe removes) names on the stream.
func (c *Client) Subscribe(names ...string) error {
	return c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: TypeURL, ResourceNamesSubscribe: names})
}

// Unsubscribe removes names from the subscription.
func (c *Client) Unsubscribe(names ...string) error {
	return c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: TypeURL, ResourceNamesUnsubscribe: names})
}

// Workloads returns the current state sorted by uid.
func (c *Client) Workloads() []*workload.Workload {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := slices.Collect(maps.Values(c.state))
	slices.SortFunc(out, func(a, b *workload.Workload) int { return strings.Compare(a.GetUid(), b.GetUid()) })
	return out
}

// Len returns how many workloads the client holds.
func (c *Client) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.state)
}

// Versions returns the version of every held workload, for
// Options.InitialVersions of a later stream.
func (c *Client) Versions() map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.versions)
}

// Close ends the stream (and the connection Dial made).
func (c *Client) Close() error {
	c.cancel()
	if c.conn != nil {
		return c.conn.Close()
	}
	return nil
}
