package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"

	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/types"
	linearcache "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"aether.io/node/agent/registry"
	"aether.io/node/agent/store"
	"aether.io/node/proxy/lds"
	"aether.io/node/wds"
)

// listenerSync keeps the per-pod Listener resources the proxy binds in each
// pod's network namespace in step with the stored records: built from a
// record when it becomes durable (and at replay), removed only at RemovePod.
// It implements pods.Observer; updates are O(listeners of one pod).
type listenerSync struct {
	cache *linearcache.LinearCache
	ports lds.Ports
	log   *slog.Logger
}

func newListenerSync(ports lds.Ports, log *slog.Logger) *listenerSync {
	return &listenerSync{cache: linearcache.NewLinearCache(lds.TypeURL), ports: ports, log: log}
}

// RecordStored builds the pod's listeners and publishes them.
func (l *listenerSync) RecordStored(rec *store.Record) {
	p := rec.Pod
	ips := make([]netip.Addr, 0, len(p.GetIps()))
	for _, s := range p.GetIps() {
		if a, err := netip.ParseAddr(s); err == nil {
			ips = append(ips, a)
		}
	}
	ls, err := lds.Build(lds.Pod{
		ContainerID: p.GetContainerId(), Namespace: p.GetNamespace(), Name: p.GetName(), UID: p.GetUid(),
		NetNSPath: p.GetNetworkNamespace(), IPs: ips, Ports: l.ports,
	})
	if err != nil {
		l.log.Error("failed to build pod listeners", "namespace", p.GetNamespace(), "name", p.GetName(),
			"container_id", p.GetContainerId(), "error", err.Error())
		return
	}
	update := make(map[string]cachev3.Resource, len(ls))
	for _, x := range ls {
		update[x.GetName()] = x
	}
	if err := l.cache.UpdateResources(update, nil); err != nil {
		l.log.Error("failed to publish pod listeners", "container_id", p.GetContainerId(), "error", err.Error())
	}
}

// RecordRemoved withdraws the pod's listeners (the proxy drains them).
func (l *listenerSync) RecordRemoved(key string) {
	names := make([]string, 0, len(lds.Roles))
	for _, r := range lds.Roles {
		names = append(names, lds.ListenerName(key, r))
	}
	if err := l.cache.UpdateResources(nil, names); err != nil {
		l.log.Error("failed to withdraw pod listeners", "container_id", key, "error", err.Error())
	}
}

// xdsServers are the agent's two discovery endpoints: workload discovery
// (istio.workload.Workload, delta and SotW, built from the registry) and the
// per-pod listeners for aether-proxy.
type xdsServers struct {
	wds      *wds.Server
	follower *wds.Follower
	lds      *grpc.Server
}

func startXDS(ctx context.Context, c *Config, reg registry.Registry, ls *listenerSync, promReg prometheus.Registerer,
	log *slog.Logger, errc chan<- error,
) (*xdsServers, error) {
	if c.XDSSocket == "" && c.XDSAddress == "" && c.LDSSocket == "" {
		return &xdsServers{}, nil
	}
	x := &xdsServers{}
	if c.XDSSocket != "" || c.XDSAddress != "" {
		idx := wds.NewIndex()
		x.follower = wds.NewFollower(reg, wds.Config{ClusterID: c.ClusterID, TrustDomain: c.TrustDomain, Network: c.Network},
			idx, log.With("component", "wds_follower"))
		srv, err := wds.NewServer(idx, wds.ServerOptions{Logger: log.With("component", "wds"), Registerer: promReg})
		if err != nil {
			return nil, fmt.Errorf("failed to create the workload discovery server: %w", err)
		}
		x.wds = srv
		go func() {
			if err := x.follower.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
				errc <- fmt.Errorf("workload discovery stopped following the registry: %w", err)
			}
		}()
		go func() {
			if err := srv.Serve(ctx, wds.ListenConfig{Socket: c.XDSSocket, TCPAddress: c.XDSAddress}); err != nil {
				errc <- err
			}
		}()
		log.Info("workload discovery serving", "socket", c.XDSSocket, "address", c.XDSAddress)
	}
	if c.LDSSocket != "" {
		ln, err := wds.ListenUnix(c.LDSSocket)
		if err != nil {
			return nil, fmt.Errorf("failed to listen on --lds-socket %q: %w", c.LDSSocket, err)
		}
		g := grpc.NewServer()
		discovery.RegisterAggregatedDiscoveryServiceServer(g, serverv3.NewServer(ctx, ls.cache, nil))
		x.lds = g
		go func() {
			if err := g.Serve(ln); err != nil {
				errc <- fmt.Errorf("listener discovery server failed: %w", err)
			}
		}()
		go func() {
			<-ctx.Done()
			g.GracefulStop()
		}()
		log.Info("listener discovery serving", "socket", c.LDSSocket)
	}
	return x, nil
}
