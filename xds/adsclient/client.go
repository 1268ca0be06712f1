// Package adsclient is aether-proxy's xDS client: one delta ADS stream
// (envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources)
// to the agent, over a unix socket or TCP, with a wildcard subscription to
// each configured type. Every response is handed to a Handler and ACKed, or
// NACKed with the handler's error. On reconnect it sends
// initial_resource_versions, so the server only sends what changed.
package adsclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
)

// Handler applies one delta response of typeURL: resources added or
// changed, and names removed. A non-nil error NACKs the response.
type Handler func(typeURL string, updated []*discovery.Resource, removed []string) error

// Client is a delta ADS client. Set the fields, then call Run.
type Client struct {
	// Target is a gRPC target: "unix:///run/aether/xds.sock" or "host:port".
	Target string
	// Node identifies the proxy to the server.
	Node *core.Node
	// TypeURLs are the types subscribed to (wildcard).
	TypeURLs []string
	// Handler receives every response.
	Handler Handler
	// Log receives connection events (nil: discarded).
	Log *slog.Logger
	// MaxBackoff bounds the reconnect backoff (default 5 s).
	MaxBackoff time.Duration

	mu       sync.Mutex
	versions map[string]map[string]string // type -> name -> version
	acks     int
}

// Acks is the number of responses ACKed so far (for tests and status).
func (c *Client) Acks() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.acks
}

// Run keeps a stream open until ctx ends, reconnecting with backoff.
func (c *Client) Run(ctx context.Context) error {
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 5 * time.Second
	}
	c.mu.Lock()
	if c.versions == nil {
		c.versions = map[string]map[string]string{}
	}
	c.mu.Unlock()
	conn, err := grpc.NewClient(c.Target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("failed to create xds client for %q: %w", c.Target, err)
	}
	defer func() { _ = conn.Close() }()
	c.Log.Info("connecting to xds server", "target", c.Target, "types", c.TypeURLs)
	backoff := 100 * time.Millisecond
	for {
		start := time.Now()
		err := c.stream(ctx, conn)
		if ctx.Err() != nil {
			return nil
		}
		if time.Since(start) > 10*time.Second {
			backoff = 100 * time.Millisecond
		}
		c.Log.Warn("xds stream ended; reconnecting", "target", c.Target, "error", err, "backoff", backoff)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, c.MaxBackoff)
	}
}

func (c *Client) stream(ctx context.Context, conn *grpc.ClientConn) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx, grpc.WaitForReady(true))
	if err != nil {
		return fmt.Errorf("failed to open delta ADS stream: %w", err)
	}
	for _, t := range c.TypeURLs {
		c.mu.Lock()
		initial := map[string]string{}
		for n, v := range c.versions[t] {
			initial[n] = v
		}
		c.mu.Unlock()
		req := &discovery.DeltaDiscoveryRequest{
			Node: c.Node, TypeUrl: t, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: initial,
		}
		if err := s.Send(req); err != nil {
			return fmt.Errorf("failed to subscribe to %s: %w", t, err)
		}
	}
	c.Log.Info("xds stream open", "target", c.Target, "types", c.TypeURLs)
	for {
		resp, err := s.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("server closed the stream")
			}
			return err
		}
		ack := &discovery.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}
		if herr := c.Handler(resp.GetTypeUrl(), resp.GetResources(), resp.GetRemovedResources()); herr != nil {
			c.Log.Error("rejected xds response", "type_url", resp.GetTypeUrl(), "nonce", resp.GetNonce(), "error", herr)
			ack.ErrorDetail = &status.Status{Code: int32(codes.InvalidArgument), Message: herr.Error()}
		} else {
			c.mu.Lock()
			vs := c.versions[resp.GetTypeUrl()]
			if vs == nil {
				vs = map[string]string{}
				c.versions[resp.GetTypeUrl()] = vs
			}
			for _, r := range resp.GetResources() {
				vs[r.GetName()] = r.GetVersion()
			}
			for _, n := range resp.GetRemovedResources() {
				delete(vs, n)
			}
			c.acks++
			c.mu.Unlock()
		}
		if err := s.Send(ack); err != nil {
			return fmt.Errorf("failed to ack %s: %w", resp.GetTypeUrl(), err)
		}
	}
}
