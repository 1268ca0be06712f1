package dataplane

import (
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/telemetry"
)

// Limits no pod can break: caps on TCP connections and UDP flows per pod and
// node-wide, a short idle timeout for DNS flows, and an idle timeout for TCP
// connections. Every hit is counted in aether_proxy_limit_hits_total{limit}.

// validate rejects limits that make no sense (after defaults).
func (c Config) validate() error {
	if c.DeliverMark == c.BypassMark || c.DeliverMark == meshcontract.DivertMark {
		return fmt.Errorf("invalid DeliverMark %#x: must differ from the bypass mark %#x and the divert mark %#x", c.DeliverMark, c.BypassMark, uint32(meshcontract.DivertMark))
	}
	for _, v := range []struct {
		name string
		n    int
	}{{"MaxConnsPerPod", c.MaxConnsPerPod}, {"MaxConns", c.MaxConns}, {"MaxUDPFlowsPerPod", c.MaxUDPFlowsPerPod}, {"MaxUDPFlows", c.MaxUDPFlows}, {"HBONEMaxConns", c.HBONEMaxConns}, {"HBONEMaxConnsPerSource", c.HBONEMaxConnsPerSource}, {"HBONESendBufs", c.HBONESendBufs}, {"HBONESendBufsPerSource", c.HBONESendBufsPerSource}} {
		if v.n < 1 {
			return fmt.Errorf("invalid %s %d: must be at least 1", v.name, v.n)
		}
	}
	if c.HBONEWindowBudget < 0 || c.HBONEWindowBudgetPerSource < 0 {
		return fmt.Errorf("invalid HBONEWindowBudget %d / HBONEWindowBudgetPerSource %d: must not be negative", c.HBONEWindowBudget, c.HBONEWindowBudgetPerSource)
	}
	for _, v := range []struct {
		name string
		d    time.Duration
	}{{"UDPIdleTimeout", c.UDPIdleTimeout}, {"DNSIdleTimeout", c.DNSIdleTimeout}, {"TCPIdleTimeout", c.TCPIdleTimeout}, {"ConnectTimeout", c.ConnectTimeout}, {"DrainTimeout", c.DrainTimeout}, {"CheckInterval", c.CheckInterval}} {
		if v.d < 0 {
			return fmt.Errorf("invalid %s %s: must not be negative", v.name, v.d)
		}
	}
	return nil
}

// File descriptors the caps cost: a proxied TCP connection holds its two
// sockets and, while spliced, one pipe (two descriptors) per direction; a
// UDP flow holds its upstream socket; an inbound HBONE connection (with
// HBONE on) its socket, from accept on. fdReserve is kept for everything
// else (listeners, netns handles, the xDS and admin connections).
const (
	fdsPerConn      = 6
	fdsPerFlow      = 1
	fdsPerHBONEConn = 1
	fdReserve       = 1024
)

// hboneFDs is the descriptors the inbound HBONE cap needs (0 with HBONE off).
func (c Config) hboneFDs() uint64 {
	if c.Certs == nil {
		return 0
	}
	return uint64(c.HBONEMaxConns) * fdsPerHBONEConn
}

// fitFDLimit lowers the node caps when the descriptors they need exceed
// the process's limit (cfg.FDLimit, or RLIMIT_NOFILE): MaxUDPFlows to a
// quarter of the budget if it needs more, MaxConns to what is left, and the
// per-pod caps to at most the node's, logging the change at WARN. A limit
// too small even for the reserve is an error.
func fitFDLimit(cfg Config, log *slog.Logger) (Config, error) {
	limit := cfg.FDLimit
	if limit == 0 {
		var rl unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
			return cfg, fmt.Errorf("failed to read RLIMIT_NOFILE: %w", err)
		}
		limit = rl.Cur
	}
	need := uint64(cfg.MaxConns)*fdsPerConn + uint64(cfg.MaxUDPFlows)*fdsPerFlow + cfg.hboneFDs() + fdReserve
	if need <= limit {
		return cfg, nil
	}
	if limit < 2*fdReserve {
		return cfg, fmt.Errorf("open file limit %d is too small for the proxy: want at least %d (%d at the configured caps); raise LimitNOFILE / the container's nofile ulimit", limit, 2*fdReserve, need)
	}
	// UDP flows keep their cap while it fits in a quarter of the budget;
	// TCP connections, the larger cost, get the rest.
	// Inbound HBONE connections likewise keep theirs within a quarter.
	budget := limit - fdReserve
	wantConns, wantFlows, wantHBONE := cfg.MaxConns, cfg.MaxUDPFlows, cfg.HBONEMaxConns
	if flows := uint64(cfg.MaxUDPFlows) * fdsPerFlow; flows > budget/4 {
		cfg.MaxUDPFlows = int(budget / 4 / fdsPerFlow)
	}
	if hb := cfg.hboneFDs(); hb > budget/4 {
		cfg.HBONEMaxConns = int(budget / 4 / fdsPerHBONEConn)
		cfg.HBONEMaxConnsPerSource = min(cfg.HBONEMaxConnsPerSource, cfg.HBONEMaxConns)
	}
	cfg.MaxConns = min(cfg.MaxConns, int((budget-uint64(cfg.MaxUDPFlows)*fdsPerFlow-cfg.hboneFDs())/fdsPerConn))
	cfg.MaxConnsPerPod = min(cfg.MaxConnsPerPod, cfg.MaxConns)
	cfg.MaxUDPFlowsPerPod = min(cfg.MaxUDPFlowsPerPod, cfg.MaxUDPFlows)
	log.Warn("open file limit too small for the connection caps; caps lowered",
		"nofile_limit", limit, "fds_needed", need,
		"max_conns", cfg.MaxConns, "max_conns_wanted", wantConns,
		"max_udp_flows", cfg.MaxUDPFlows, "max_udp_flows_wanted", wantFlows,
		"max_conns_per_pod", cfg.MaxConnsPerPod, "max_udp_flows_per_pod", cfg.MaxUDPFlowsPerPod,
		"hbone_max_conns", cfg.HBONEMaxConns, "hbone_max_conns_wanted", wantHBONE,
		"fix", "raise LimitNOFILE or the container's nofile ulimit")
	return cfg, nil
}

// admitTCP takes a slot for one accepted connection under the pod's and
// the node's caps. It returns the release function, or the limit hit.
func (p *pod) admitTCP() (release func(), limit string) {
	if p.tcpConns.Add(1) > int64(p.m.cfg.MaxConnsPerPod) {
		p.tcpConns.Add(-1)
		return nil, telemetry.LimitPodConnections
	}
	if p.m.tcpConns.Add(1) > int64(p.m.cfg.MaxConns) {
		p.m.tcpConns.Add(-1)
		p.tcpConns.Add(-1)
		return nil, telemetry.LimitNodeConnections
	}
	return func() {
		p.tcpConns.Add(-1)
		p.m.tcpConns.Add(-1)
	}, ""
}

// flow returns the open flow of key, if any.
func (p *pod) flow(key flowKey) *udpFlow {
	p.flowMu.Lock()
	defer p.flowMu.Unlock()
	return p.flows[key]
}

// addFlow records a new flow of the pod.
func (p *pod) addFlow(key flowKey, f *udpFlow) {
	p.flowMu.Lock()
	defer p.flowMu.Unlock()
	p.flows[key] = f
	p.m.udpFlows.Add(1)
}

// dropFlow forgets an ended flow (its done callback).
func (p *pod) dropFlow(key flowKey, f *udpFlow) {
	p.flowMu.Lock()
	defer p.flowMu.Unlock()
	if f != nil && p.flows[key] == f {
		delete(p.flows, key)
		p.m.udpFlows.Add(-1)
	}
}

// evictLRU ends the pod's least recently used flow; false when it has none.
func (p *pod) evictLRU() bool {
	p.flowMu.Lock()
	var oldest *udpFlow
	for _, f := range p.flows {
		if oldest == nil || f.last.Load() < oldest.last.Load() {
			oldest = f
		}
	}
	p.flowMu.Unlock()
	if oldest == nil {
		return false
	}
	oldest.abort() // its done callback forgets it
	return true
}

// admitFlow makes room for one more flow of the pod under both caps, by
// evicting the pod's own least recently used flows. It reports false when
// the node is full and the pod holds no flow to give up.
func (p *pod) admitFlow() bool {
	if p.m.udpFlows.Load() >= int64(p.m.cfg.MaxUDPFlows) {
		p.m.metrics.LimitHit(telemetry.LimitNodeUDPFlows)
		if !p.evictLRU() {
			return false
		}
	}
	for {
		p.flowMu.Lock()
		n := len(p.flows)
		p.flowMu.Unlock()
		if n < p.m.cfg.MaxUDPFlowsPerPod {
			return true
		}
		p.m.metrics.LimitHit(telemetry.LimitPodUDPFlows)
		if !p.evictLRU() {
			return true
		}
	}
}

// closeIdle closes, in every pod, the TCP connections idle both ways for
// TCPIdleTimeout.
func (m *Manager) closeIdle() {
	for _, p := range m.allPods() {
		p.closeIdle(m.cfg.TCPIdleTimeout)
	}
}

func (p *pod) closeIdle(timeout time.Duration) {
	for _, c := range connsOf[idler](p) {
		if c.idle() >= timeout {
			p.m.metrics.LimitHit(telemetry.LimitTCPIdle)
			p.log.Debug("closing idle connection", "conn", c.String(), "timeout", timeout)
			abortFor(c, telemetry.ReasonIdleTimeout)
		}
	}
}

// idler is a tracked TCP connection the idle timeout applies to: a plain
// proxied pair (tcpPair), a captured connection tunnelled over HBONE
// (streamPair), or the app side of an inbound HBONE stream (inboundConn).
type idler interface {
	closer
	// idle is how long no data moved either way; 0 when it cannot tell.
	idle() time.Duration
	// String names the connection's ends for the log.
	String() string
}

// idle is the time since the pair last moved data: both sockets' TCP_INFO.
func (t *tcpPair) idle() time.Duration {
	idle := idleFor(t.down)
	if up, ok := t.up.(*net.TCPConn); ok { // a unix socket has no TCP_INFO: the client side tells
		idle = min(idle, idleFor(up))
	}
	return idle
}

func (t *tcpPair) String() string {
	return t.down.RemoteAddr().String() + " -> " + t.up.RemoteAddr().String()
}

// activity is the time data last moved through a connection whose other
// side has no socket of its own (an HBONE stream shares its TCP connection
// with other streams): the copies stamp it, the idle check reads it.
type activity struct{ last atomic.Int64 }

func (a *activity) touch() { a.last.Store(time.Now().UnixNano()) }

func (a *activity) since() time.Duration { return time.Since(time.Unix(0, a.last.Load())) }

// idleFor is how long c has neither sent nor received data (from
// TCP_INFO); 0 when it cannot tell.
func idleFor(c *net.TCPConn) time.Duration {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var idle time.Duration
	_ = rc.Control(func(fd uintptr) {
		ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			return
		}
		idle = time.Duration(min(ti.Last_data_sent, ti.Last_data_recv)) * time.Millisecond
	})
	return idle
}
