// Package adsclient is aether-node's one delta xDS client: a delta ADS
// stream (envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources)
// over a unix socket or TCP, subscribed to each configured type, by wildcard
// or by name. Every response is handed to a Handler and ACKed, or NACKed
// with the handler's error. The client remembers the version of every
// resource it ACKed; a new stream (a reconnect, or a first stream seeded
// with InitialVersions) sends them as initial_resource_versions, so the
// server only sends what changed. The versions are kept in that request's
// wire form, in the order the server sent them (Versions): a reconnect
// sends them as they are, since it holds every resource.
//
// aether-proxy runs it reconnecting forever; aetherctl and the tests run it
// Once (one stream, its error returned) through xds/workload/client.
package adsclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Wildcard is the resource name that subscribes to every resource of a type.
const Wildcard = "*"

// Handler applies one delta response of typeURL: resources added or
// changed, and names removed. A non-nil error NACKs the response.
type Handler func(typeURL string, updated []*discovery.Resource, removed []string) error

// Client is a delta ADS client. Set the fields, then call Run (once).
type Client struct {
	// Target is a gRPC target: "unix:///run/aether/proxy/xds.sock" or "host:port".
	Target string
	// Node identifies the client to the server.
	Node *core.Node
	// TypeURLs are the types subscribed to, in this order.
	TypeURLs []string
	// Names are the resource names subscribed to per type; a type without
	// names is subscribed by wildcard.
	Names map[string][]string
	// InitialVersions are versions the client already holds per type (from
	// an earlier process): the first stream sends them as
	// initial_resource_versions. Later streams send what was ACKed since.
	InitialVersions map[string]map[string]string
	// Handler receives every response.
	Handler Handler
	// Log receives connection events (nil: discarded).
	Log *slog.Logger
	// MaxBackoff bounds the reconnect backoff (default 5 s).
	MaxBackoff time.Duration
	// MaxMessageBytes bounds a received response (0: gRPC's default, 4 MiB).
	// Servers that do not split responses send the whole state at once.
	MaxMessageBytes int
	// TLS secures the connection (mutual TLS to an --xds-address beyond
	// loopback); nil dials without transport security (unix sockets).
	TLS *tls.Config
	// Once makes Run open a single stream, without waiting for the server to
	// become reachable, and return its error when it ends instead of
	// reconnecting.
	Once bool

	mu       sync.Mutex
	versions map[string]*Versions // per type
	acks     int
	synced   map[string]bool
	syncedCh chan struct{}
	isSynced bool
	cur      discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	sendMu   sync.Mutex // serialises Sends on stream
}

// Acks is the number of responses ACKed so far (for tests and status).
func (c *Client) Acks() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.acks
}

// Synced is closed once the first response of every subscribed type has
// been ACKed: the client holds the server's state. A server answers every
// subscription, even with an empty response.
func (c *Client) Synced() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.initLocked()
	return c.syncedCh
}

// Versions returns the version of every ACKed resource of typeURL.
func (c *Client) Versions(typeURL string) map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if vs := c.versions[typeURL]; vs != nil {
		return vs.Map()
	}
	return nil
}

// Subscribe adds names to the subscription of typeURL, on the open stream
// (if any) and for later streams.
func (c *Client) Subscribe(typeURL string, names ...string) error {
	return c.change(typeURL, names, true)
}

// Unsubscribe removes names from the subscription of typeURL.
func (c *Client) Unsubscribe(typeURL string, names ...string) error {
	return c.change(typeURL, names, false)
}

func (c *Client) change(typeURL string, names []string, subscribe bool) error {
	c.mu.Lock()
	if c.Names == nil {
		c.Names = map[string][]string{}
	}
	cur, named := c.Names[typeURL]
	if !named {
		cur = []string{Wildcard}
	}
	if subscribe {
		for _, n := range names {
			if !slices.Contains(cur, n) {
				cur = append(cur, n)
			}
		}
	} else {
		cur = slices.DeleteFunc(slices.Clone(cur), func(n string) bool { return slices.Contains(names, n) })
		if len(cur) == 0 {
			cur = []string{} // nothing, not the wildcard
		}
	}
	c.Names[typeURL] = cur
	s := c.cur
	c.mu.Unlock()
	if s == nil {
		return nil
	}
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: typeURL}
	if subscribe {
		req.ResourceNamesSubscribe = names
	} else {
		req.ResourceNamesUnsubscribe = names
	}
	if err := c.send(s, req); err != nil {
		return fmt.Errorf("failed to change subscription to %s: %w", typeURL, err)
	}
	return nil
}

func (c *Client) initLocked() {
	if c.versions == nil {
		c.versions = map[string]*Versions{}
		for t, vs := range c.InitialVersions {
			c.versions[t] = NewVersions(vs)
		}
	}
	if c.syncedCh == nil {
		c.syncedCh = make(chan struct{})
		c.synced = map[string]bool{}
	}
}

// Run keeps a stream open until ctx ends, reconnecting with backoff (or,
// with Once, until its one stream ends). It returns nil when ctx ends.
func (c *Client) Run(ctx context.Context) error {
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 5 * time.Second
	}
	c.mu.Lock()
	c.initLocked()
	c.mu.Unlock()
	creds := insecure.NewCredentials()
	if c.TLS != nil {
		creds = credentials.NewTLS(c.TLS)
	}
	callOpts := []grpc.CallOption{grpc.ForceCodecV2(Codec())}
	if c.MaxMessageBytes > 0 {
		callOpts = append(callOpts, grpc.MaxCallRecvMsgSize(c.MaxMessageBytes), grpc.MaxCallSendMsgSize(c.MaxMessageBytes))
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds), grpc.WithDefaultCallOptions(callOpts...)}
	conn, err := grpc.NewClient(c.Target, opts...)
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
		if c.Once {
			return err
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

func (c *Client) send(s discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient, req *discovery.DeltaDiscoveryRequest) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	return s.Send(req)
}

func (c *Client) stream(ctx context.Context, conn *grpc.ClientConn) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx, grpc.WaitForReady(!c.Once))
	if err != nil {
		return fmt.Errorf("failed to open delta ADS stream: %w", err)
	}
	// Subscriptions and the stream are published together, so a concurrent
	// Subscribe is either in the first request or sent after it. The
	// versions are kept in wire form (Versions): a reconnect's first
	// request sends them as they are.
	c.sendMu.Lock()
	c.mu.Lock()
	reqs := make([]*EncodedRequest, 0, len(c.TypeURLs))
	for _, t := range c.TypeURLs {
		names, named := c.Names[t]
		if !named {
			names = []string{Wildcard}
		}
		b, err := c.versions[t].Request(&discovery.DeltaDiscoveryRequest{Node: c.Node, TypeUrl: t, ResourceNamesSubscribe: names})
		if err != nil {
			c.mu.Unlock()
			c.sendMu.Unlock()
			return err
		}
		reqs = append(reqs, b)
	}
	c.cur = s
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.cur = nil
		c.mu.Unlock()
	}()
	for i, req := range reqs {
		if err := s.SendMsg(req); err != nil {
			c.sendMu.Unlock()
			return fmt.Errorf("failed to subscribe to %s: %w", c.TypeURLs[i], err)
		}
	}
	c.sendMu.Unlock()
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
			c.applied(resp)
		}
		if err := c.send(s, ack); err != nil {
			return fmt.Errorf("failed to ack %s: %w", resp.GetTypeUrl(), err)
		}
	}
}

// applied records the versions of an ACKed response and closes Synced once
// every subscribed type has had one.
func (c *Client) applied(resp *discovery.DeltaDiscoveryResponse) {
	c.mu.Lock()
	defer c.mu.Unlock()
	vs := c.versions[resp.GetTypeUrl()]
	if vs == nil {
		vs = &Versions{}
		c.versions[resp.GetTypeUrl()] = vs
	}
	for _, r := range resp.GetResources() {
		vs.Set(r.GetName(), r.GetVersion())
	}
	for _, n := range resp.GetRemovedResources() {
		vs.Delete(n)
	}
	c.acks++
	if c.isSynced {
		return
	}
	c.synced[resp.GetTypeUrl()] = true
	for _, t := range c.TypeURLs {
		if !c.synced[t] {
			return
		}
	}
	c.isSynced = true
	close(c.syncedCh)
}
