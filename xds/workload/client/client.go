// Package client is the istio.workload.Workload view of xds/adsclient: one
// delta stream (adsclient.Client, run Once) subscribed to the workload type,
// wildcard or by uid, whose responses are decoded into Workloads, kept as
// the client's state and handed out one at a time by Recv. It works against
// any server of the type, not only ours. It also holds `aetherctl workloads`
// (Run).
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"

	"aether.io/node/api/istio/security"
	"aether.io/node/api/istio/workload"
	"aether.io/node/xds/adsclient"
	"aether.io/node/xds/resource"
)

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
	// TLS secures a connection to Address (nil: none).
	TLS *tls.Config
	// Addresses subscribes to istio.workload.Address (workloads and
	// Services, what ztunnel and aether-proxy consume) instead of
	// istio.workload.Workload.
	Addresses bool
	// Authorizations also subscribes to istio.security.Authorization (the
	// policies; Client.Policies), on the same stream.
	Authorizations bool
}

// Update is what one response changed.
type Update struct {
	// Updated are the workloads added or changed, in response order.
	Updated []*workload.Workload
	// Services are the Services added or changed (Options.Addresses).
	Services []*workload.Service
	// Policies are the authorization policies added or changed
	// (Options.Authorizations).
	Policies []*security.Authorization
	// Removed are the names removed (workload uids, Services'
	// <namespace>/<hostname>, policies' <namespace>/<name>).
	Removed []string
}

// response is one decoded response handed from the stream to Recv.
type response struct {
	up  *Update
	err error
}

// Client is one delta ADS stream of workloads.
type Client struct {
	ads    *adsclient.Client
	ctx    context.Context
	cancel context.CancelFunc
	events chan response
	done   chan struct{} // closed when the stream has ended
	runErr error         // why, once done is closed

	typeURL string

	mu       sync.Mutex
	state    map[string]*workload.Workload
	services map[string]*workload.Service
	policies map[string]*security.Authorization
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

// Dial opens the stream and sends the subscription; read the responses
// with Recv. A server that cannot be reached shows as Recv's error.
func Dial(ctx context.Context, opts Options) (*Client, error) {
	target, err := Target(opts)
	if err != nil {
		return nil, err
	}
	maxMsg := opts.MaxMessageBytes
	if maxMsg <= 0 {
		maxMsg = 1 << 30
	}
	node := opts.NodeID
	if node == "" {
		node = "aetherctl"
	}
	c := &Client{
		events:   make(chan response),
		done:     make(chan struct{}),
		state:    make(map[string]*workload.Workload),
		services: make(map[string]*workload.Service),
		policies: make(map[string]*security.Authorization),
		typeURL:  resource.WorkloadType,
	}
	if opts.Addresses {
		c.typeURL = resource.AddressType
	}
	c.ads = &adsclient.Client{
		Target: target, Node: &core.Node{Id: node}, TypeURLs: []string{c.typeURL},
		Handler: c.handle, MaxMessageBytes: maxMsg, Once: true, TLS: opts.TLS,
	}
	if opts.Authorizations {
		c.ads.TypeURLs = append(c.ads.TypeURLs, resource.AuthorizationType)
	}
	if len(opts.Names) > 0 {
		c.ads.Names = map[string][]string{c.typeURL: slices.Clone(opts.Names)}
	}
	if opts.InitialVersions != nil {
		c.ads.InitialVersions = map[string]map[string]string{c.typeURL: opts.InitialVersions}
	}
	c.ctx, c.cancel = context.WithCancel(ctx)
	go func() {
		defer close(c.done)
		err := c.ads.Run(c.ctx)
		if err == nil {
			err = c.ctx.Err()
		}
		if err == nil {
			err = errors.New("stream ended")
		}
		c.runErr = err
	}()
	return c, nil
}

// handle decodes a response, applies it to the state and waits for Recv to
// take it. A response that does not decode is NACKed and leaves the state
// alone.
func (c *Client) handle(typeURL string, updated []*discovery.Resource, removed []string) error {
	want := c.typeURL
	if typeURL == resource.AuthorizationType {
		want = typeURL
	}
	up, err := decode(want, typeURL, updated, removed)
	if err == nil {
		c.mu.Lock()
		for _, w := range up.Updated {
			c.state[w.GetUid()] = w
		}
		for _, sv := range up.Services {
			c.services[sv.GetNamespace()+"/"+sv.GetHostname()] = sv
		}
		for _, a := range up.Policies {
			c.policies[a.GetNamespace()+"/"+a.GetName()] = a
		}
		for _, n := range up.Removed {
			if typeURL == resource.AuthorizationType {
				delete(c.policies, n)
				continue
			}
			delete(c.state, n)
			delete(c.services, n)
		}
		c.mu.Unlock()
	}
	select {
	case c.events <- response{up: up, err: err}:
	case <-c.ctx.Done():
	}
	return err
}

// Recv waits for the next response (already applied to the state and
// ACKed). A response that does not decode is NACKed and returned as an
// error; so is the end of the stream.
func (c *Client) Recv() (*Update, error) {
	select {
	case ev := <-c.events:
		return ev.up, ev.err
	case <-c.done:
		return nil, fmt.Errorf("failed to receive delta xds response: %w", c.runErr)
	}
}

func decode(want, typeURL string, updated []*discovery.Resource, removed []string) (*Update, error) {
	if typeURL != want {
		return nil, fmt.Errorf("unexpected type %q in response, want %q", typeURL, want)
	}
	up := &Update{Removed: removed}
	for _, r := range updated {
		a := r.GetResource()
		if a.GetTypeUrl() != want {
			return nil, fmt.Errorf("resource %q has type %q, want %q", r.GetName(), a.GetTypeUrl(), want)
		}
		if want == resource.AuthorizationType {
			pol := &security.Authorization{}
			if err := proto.Unmarshal(a.GetValue(), pol); err != nil {
				return nil, fmt.Errorf("failed to decode authorization %q: %w", r.GetName(), err)
			}
			up.Policies = append(up.Policies, pol)
			continue
		}
		w := &workload.Workload{}
		if want == resource.AddressType {
			ad := &workload.Address{}
			if err := proto.Unmarshal(a.GetValue(), ad); err != nil {
				return nil, fmt.Errorf("failed to decode address %q: %w", r.GetName(), err)
			}
			if sv := ad.GetService(); sv != nil {
				if n := sv.GetNamespace() + "/" + sv.GetHostname(); n != r.GetName() {
					return nil, fmt.Errorf("resource name %q differs from its service %q", r.GetName(), n)
				}
				up.Services = append(up.Services, sv)
				continue
			}
			if w = ad.GetWorkload(); w == nil {
				return nil, fmt.Errorf("address %q carries neither a workload nor a service", r.GetName())
			}
		} else if err := proto.Unmarshal(a.GetValue(), w); err != nil {
			return nil, fmt.Errorf("failed to decode workload %q: %w", r.GetName(), err)
		}
		if w.GetUid() != r.GetName() {
			return nil, fmt.Errorf("resource name %q differs from its uid %q", r.GetName(), w.GetUid())
		}
		up.Updated = append(up.Updated, w)
	}
	return up, nil
}

// Subscribe adds uids to the subscription.
func (c *Client) Subscribe(names ...string) error {
	return c.ads.Subscribe(c.typeURL, names...)
}

// Unsubscribe removes uids from the subscription.
func (c *Client) Unsubscribe(names ...string) error {
	return c.ads.Unsubscribe(c.typeURL, names...)
}

// Workloads returns the current state sorted by uid.
func (c *Client) Workloads() []*workload.Workload {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := slices.Collect(maps.Values(c.state))
	slices.SortFunc(out, func(a, b *workload.Workload) int { return strings.Compare(a.GetUid(), b.GetUid()) })
	return out
}

// Services returns the Services held (Options.Addresses), sorted by
// <namespace>/<hostname>.
func (c *Client) Services() []*workload.Service {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := slices.Sorted(maps.Keys(c.services))
	out := make([]*workload.Service, len(keys))
	for i, k := range keys {
		out[i] = c.services[k]
	}
	return out
}

// Policies returns the authorization policies held
// (Options.Authorizations), sorted by <namespace>/<name>.
func (c *Client) Policies() []*security.Authorization {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := slices.Sorted(maps.Keys(c.policies))
	out := make([]*security.Authorization, len(keys))
	for i, k := range keys {
		out[i] = c.policies[k]
	}
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
	return c.ads.Versions(c.typeURL)
}

// Close ends the stream and waits for it.
func (c *Client) Close() error {
	c.cancel()
	<-c.done
	return nil
}
