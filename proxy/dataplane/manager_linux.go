package dataplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"aether.io/node/pkg/meshcontract"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/listener"
)

// Defaults of Config.
const (
	DefaultBypassMark     = meshcontract.BypassMark
	DefaultDeliverMark    = meshcontract.DeliverMark
	DefaultConnectTimeout = 10 * time.Second
	DefaultDrainTimeout   = 30 * time.Second
	DefaultCheckInterval  = time.Second
	DefaultUDPIdleTimeout = 30 * time.Second

	// DefaultMaxConnsPerPod and DefaultMaxConns cap the open proxied TCP
	// connections of one pod and of the node.
	DefaultMaxConnsPerPod = 8192
	DefaultMaxConns       = 65536
	// DefaultMaxUDPFlowsPerPod and DefaultMaxUDPFlows cap the open UDP
	// flows of one pod (its least recently used flow makes room) and of
	// the node.
	DefaultMaxUDPFlowsPerPod = 1024
	DefaultMaxUDPFlows       = 16384
	// DefaultDNSIdleTimeout ends a UDP flow to port 53 (a query and its
	// answer) sooner than other flows.
	DefaultDNSIdleTimeout = 5 * time.Second
	// DefaultTCPIdleTimeout closes a proxied TCP connection with no data
	// either way for this long.
	DefaultTCPIdleTimeout = time.Hour
	// DefaultHBONEPort is the port every HBONE pod listens on (Istio's).
	DefaultHBONEPort = hbone.DefaultPort
	// DefaultHBONEMaxConns and DefaultHBONEMaxConnsPerSource cap the
	// node's inbound HBONE connections (every pod's :15008, handshakes
	// included) in total and per source address.
	DefaultHBONEMaxConns          = hbone.DefaultMaxConns
	DefaultHBONEMaxConnsPerSource = hbone.DefaultMaxConnsPerSource
	// DefaultHBONEWindowBudget and DefaultHBONEWindowBudgetPerSource
	// bound the HTTP/2 receive window (so the data queued for apps or pods
	// that do not read) beyond 64 KiB per connection, in bytes, for the
	// inbound side (per source address) and, separately, the outbound
	// side (per source pod).
	DefaultHBONEWindowBudget          = hbone.DefaultWindowBudget
	DefaultHBONEWindowBudgetPerSource = hbone.DefaultWindowBudgetPerSource
	// DefaultHBONESendBufs and DefaultHBONESendBufsPerSource bound the
	// 256 KiB send buffers held at once (64 MiB, 8 MiB per source), for
	// the inbound side (per source address) and, separately, the outbound
	// side (per source pod).
	DefaultHBONESendBufs          = hbone.DefaultSendBufs
	DefaultHBONESendBufsPerSource = hbone.DefaultSendBufsPerSource
	// DefaultHBONEControlBudget and DefaultHBONEControlBudgetPerSource
	// bound the HTTP/2 control frames (PING and SETTINGS acks, resets,
	// WINDOW_UPDATEs) queued for peers beyond 16 KiB per connection, in
	// bytes, inbound (per source address) and, separately, outbound (per
	// source pod).
	DefaultHBONEControlBudget          = hbone.DefaultControlBudget
	DefaultHBONEControlBudgetPerSource = hbone.DefaultControlBudgetPerSource
)

// Config tunes the data plane. Zero fields take the defaults.
type Config struct {
	// Services balances captured connections to Service VIPs
	// (peers.Services); nil: a VIP is dialled as any other address.
	Services ServiceChooser
	// Authorizer decides, from authorization policy, whether an inbound
	// connection reaches its pod (authz.Table); nil: every one does.
	Authorizer Authorizer
	// BypassMark is the SO_MARK of every upstream socket (the divert's
	// bypass mark).
	BypassMark uint32
	// DeliverMark is the SO_MARK of inbound delivery sockets bound to the
	// client's address (the divert's deliver mark): the app sees the
	// client's address, not the pod's, where the divert's deliver rule is
	// in place.
	DeliverMark uint32
	// ConnectTimeout bounds an upstream TCP connect.
	ConnectTimeout time.Duration
	// DrainTimeout bounds how long a removed pod's open connections may
	// run before they are closed.
	DrainTimeout time.Duration
	// CheckInterval is how often pinned netns paths are checked and failed
	// binds retried.
	CheckInterval time.Duration
	// UDPIdleTimeout ends a UDP flow with no datagram either way.
	UDPIdleTimeout time.Duration
	// DNSIdleTimeout is UDPIdleTimeout for flows to port 53.
	DNSIdleTimeout time.Duration
	// TCPIdleTimeout closes a TCP connection idle both ways (checked every
	// CheckInterval from the sockets' TCP_INFO).
	TCPIdleTimeout time.Duration
	// MaxConnsPerPod and MaxConns cap open TCP connections per pod and
	// node-wide; a connection over a cap is reset and counted.
	MaxConnsPerPod, MaxConns int
	// ShutdownDrain is how long Run, when its context ends (SIGTERM),
	// lets established connections finish after every pod stopped
	// accepting (readiness 503), before it closes what is left; 0 closes
	// everything at once.
	ShutdownDrain time.Duration
	// MaxUDPFlowsPerPod and MaxUDPFlows cap open UDP flows per pod (the
	// pod's least recently used flow is evicted for a new one) and
	// node-wide (the new flow evicts the pod's own least recently used
	// flow, or is dropped when the pod has none: one pod never evicts
	// another's flows).
	MaxUDPFlowsPerPod, MaxUDPFlows int
	// FDLimit is the number of file descriptors the process may hold; 0
	// reads RLIMIT_NOFILE. Node-wide caps that would need more are
	// lowered at New (see fitFDLimit), so a flood meets a cap, never
	// EMFILE, which would fail every other pod's connections too.
	FDLimit uint64
	// HBONEDeclaredPortsOnly refuses (403) an HBONE stream to a port the
	// destination pod's containers do not declare, before any connection
	// to the app; a pod whose declared ports are unknown (an agent that
	// predates them) is delivered to on every port. Off: every port.
	HBONEDeclaredPortsOnly bool
	// Certs (the proxy's identity.Watcher) turns HBONE on: pods whose
	// listeners carry a SPIFFE ID serve HBONE on HBONEPort, and captured
	// connections to HBONE workloads are tunnelled. nil: no HBONE.
	Certs hbone.Certs
	// HBONEPort is the pods' HBONE port.
	HBONEPort uint16
	// UDSRoot is <uds-csi-root>, below which the pods' socket dirs are
	// (meshcontract.PodSocketDir); inbound UDS delivery connects only to a
	// socket directly in the pod's own dir there (dialPodSocket).
	// Default meshcontract.DefaultUDSCSIRoot.
	UDSRoot string
	// HBONEMaxConns and HBONEMaxConnsPerSource cap the inbound HBONE
	// connections of the node, handshakes included, in total and per
	// source address; one over a cap is closed at accept and counted.
	// They count in the file-descriptor budget (fitFDLimit).
	HBONEMaxConns, HBONEMaxConnsPerSource int
	// HBONEWindowBudget and HBONEWindowBudgetPerSource bound, in bytes,
	// the receive window HBONE connections grant beyond 64 KiB each:
	// inbound in total and per source address, outbound (the dialer) in
	// total and per source pod.
	HBONEWindowBudget, HBONEWindowBudgetPerSource int64
	// HBONESendBufs and HBONESendBufsPerSource bound the 256 KiB send
	// buffers HBONE streams hold at once while their writes wait for a
	// peer that reads slowly: inbound in total and per source address,
	// outbound (the dialer) in total and per source pod.
	HBONESendBufs, HBONESendBufsPerSource int
	// HBONEControlBudget and HBONEControlBudgetPerSource bound, in bytes,
	// the control frames HBONE connections queue for peers that do not
	// read them, beyond 16 KiB each: inbound in total and per source
	// address, outbound in total and per source pod. A connection past
	// them is closed as a control flood.
	HBONEControlBudget, HBONEControlBudgetPerSource int64
}

func (c Config) withDefaults() Config {
	if c.UDSRoot == "" {
		c.UDSRoot = meshcontract.DefaultUDSCSIRoot
	}
	if c.BypassMark == 0 {
		c.BypassMark = DefaultBypassMark
	}
	if c.DeliverMark == 0 {
		c.DeliverMark = DefaultDeliverMark
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = DefaultConnectTimeout
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.CheckInterval == 0 {
		c.CheckInterval = DefaultCheckInterval
	}
	if c.UDPIdleTimeout == 0 {
		c.UDPIdleTimeout = DefaultUDPIdleTimeout
	}
	if c.DNSIdleTimeout == 0 {
		c.DNSIdleTimeout = DefaultDNSIdleTimeout
	}
	if c.TCPIdleTimeout == 0 {
		c.TCPIdleTimeout = DefaultTCPIdleTimeout
	}
	if c.MaxConnsPerPod == 0 {
		c.MaxConnsPerPod = DefaultMaxConnsPerPod
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.MaxUDPFlowsPerPod == 0 {
		c.MaxUDPFlowsPerPod = DefaultMaxUDPFlowsPerPod
	}
	if c.MaxUDPFlows == 0 {
		c.MaxUDPFlows = DefaultMaxUDPFlows
	}
	if c.HBONEPort == 0 {
		c.HBONEPort = DefaultHBONEPort
	}
	if c.HBONEMaxConns == 0 {
		c.HBONEMaxConns = DefaultHBONEMaxConns
	}
	if c.HBONEMaxConnsPerSource == 0 {
		c.HBONEMaxConnsPerSource = DefaultHBONEMaxConnsPerSource
	}
	if c.HBONEWindowBudget == 0 {
		c.HBONEWindowBudget = DefaultHBONEWindowBudget
	}
	if c.HBONEWindowBudgetPerSource == 0 {
		c.HBONEWindowBudgetPerSource = DefaultHBONEWindowBudgetPerSource
	}
	if c.HBONESendBufs == 0 {
		c.HBONESendBufs = DefaultHBONESendBufs
	}
	if c.HBONESendBufsPerSource == 0 {
		c.HBONESendBufsPerSource = DefaultHBONESendBufsPerSource
	}
	if c.HBONEControlBudget == 0 {
		c.HBONEControlBudget = DefaultHBONEControlBudget
	}
	if c.HBONEControlBudgetPerSource == 0 {
		c.HBONEControlBudgetPerSource = DefaultHBONEControlBudgetPerSource
	}
	return c
}

// PeerLookup finds the workload holding an address (peers.Index).
type PeerLookup interface {
	Lookup(addr netip.Addr) (peers.Peer, bool)
}

// State is a pod's data-plane state.
type State string

// Pod states.
const (
	// StateServing: every listener is bound and served.
	StateServing State = "serving"
	// StateDraining: removed; not accepting, readiness 503, open
	// connections finishing.
	StateDraining State = "draining"
	// StateFailed: the listeners could not be bound; retried every
	// CheckInterval.
	StateFailed State = "failed"
)

// PodStatus describes one pod for operators and tests.
type PodStatus struct {
	Key       string
	Namespace string
	Name      string
	NetNS     string
	State     State
	// Conns is the number of open proxied connections and UDP flows.
	Conns int
	// UDPFlows is the number of open UDP flows.
	UDPFlows int
	// Error is the last bind error of a failed pod.
	Error string
	// UDSSocket is the host path inbound traffic is delivered to (the
	// listeners' uds_socket metadata); empty: TCP to the pod's address.
	UDSSocket string
	// DeclaredPortsKnown and DeclaredTCPPorts are the pod's declared TCP
	// ports as its listeners carry them (HBONEDeclaredPortsOnly delivers
	// HBONE only to those when known).
	DeclaredPortsKnown bool
	DeclaredTCPPorts   []uint16
}

// Manager owns every pod's listeners. Construct it with New, feed it the
// desired listeners with SetListeners, and run it with Run.
type Manager struct {
	cfg     Config
	log     *slog.Logger
	peers   PeerLookup
	metrics *telemetry.Metrics
	home    int

	mu       sync.Mutex
	desired  map[string][]listener.Spec // pod key -> listeners, sorted by name
	pods     map[string]*pod            // serving pods
	draining map[*pod]struct{}
	failed   map[string]string // pod key -> last bind error
	kick     chan struct{}
	ctx      context.Context // set by Run

	// tunnel opens the HBONE streams of every pod (nil: HBONE off); podSeq
	// numbers pod instances for its pool.
	tunnel *hbone.Dialer
	podSeq atomic.Uint64
	// hbBudget caps the connections and receive windows of every pod's
	// HBONE server together.
	hbBudget *hbone.Budget
	// servers are the pods' HBONE servers being served; retired sums the
	// counters of those that shut down (aether_proxy_hbone_*).
	hbMu    sync.Mutex
	servers map[*hbone.Server]struct{}
	retired hbone.ServerStats

	// tcpConns and udpFlows count the node's open connections and flows
	// (the caps of Config).
	tcpConns, udpFlows atomic.Int64

	// pipes are the splice pipes of the TCP copies (closed with Close).
	pipes pipePool

	// handedOff: the pods were handed over to a successor (Retire); no pod
	// is bound any more.
	handedOff bool
	// inherited are the sockets a predecessor handed over that no pod took
	// yet, by handover.Key (handover_linux.go).
	inhMu     sync.Mutex
	inherited map[string]*os.File
	// settle asks Run for a reconcile whose end closes the channel sent.
	settle chan chan struct{}
}

// New returns a manager. It opens the process's own netns (to return to
// after creating a socket in a pod's) and does no other I/O.
func New(cfg Config, lookup PeerLookup, m *telemetry.Metrics, log *slog.Logger) (*Manager, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if m == nil {
		m = telemetry.New()
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg, err := fitFDLimit(cfg, log)
	if err != nil {
		return nil, err
	}
	home, err := openHome()
	if err != nil {
		return nil, err
	}
	mg := &Manager{
		cfg: cfg, log: log, peers: lookup, metrics: m, home: home,
		desired: map[string][]listener.Spec{}, pods: map[string]*pod{}, draining: map[*pod]struct{}{},
		failed: map[string]string{}, kick: make(chan struct{}, 1), servers: map[*hbone.Server]struct{}{},
		inherited: map[string]*os.File{}, settle: make(chan chan struct{}),
	}
	if cfg.Certs != nil {
		mg.hbBudget, err = hbone.NewBudget(hbone.BudgetConfig{
			MaxConns: cfg.HBONEMaxConns, MaxConnsPerSource: cfg.HBONEMaxConnsPerSource,
			Window: cfg.HBONEWindowBudget, WindowPerSource: cfg.HBONEWindowBudgetPerSource,
			SendBufs: cfg.HBONESendBufs, SendBufsPerSource: cfg.HBONESendBufsPerSource,
			Control: cfg.HBONEControlBudget, ControlPerSource: cfg.HBONEControlBudgetPerSource,
		})
		if err == nil {
			mg.tunnel, err = mg.newTunnel()
		}
		if err == nil {
			err = m.RegisterHBONE(mg.HBONEStats)
		}
		if err != nil {
			_ = closeFd(home)
			return nil, err
		}
	}
	return mg, nil
}

// SetListeners replaces the desired listeners (the proxy's whole LDS state).
// Pods whose listeners appear are bound, pods whose listeners changed are
// drained and bound again (a change of the inbound policy alone applies in
// place, from the next connection), pods whose listeners are gone are
// drained.
func (m *Manager) SetListeners(specs []listener.Spec) {
	byPod := map[string][]listener.Spec{}
	for _, s := range specs {
		byPod[s.PodKey] = append(byPod[s.PodKey], s)
	}
	for _, ss := range byPod {
		sort.Slice(ss, func(i, j int) bool { return ss[i].Name < ss[j].Name })
	}
	m.mu.Lock()
	m.desired = byPod
	m.mu.Unlock()
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// Run reconciles until ctx ends, then closes every pod at once.
func (m *Manager) Run(ctx context.Context) error {
	m.mu.Lock()
	m.ctx = ctx
	m.mu.Unlock()
	t := time.NewTicker(m.cfg.CheckInterval)
	defer t.Stop()
	for {
		m.reconcile(ctx)
		select {
		case <-ctx.Done():
			m.shutdown()
			return nil
		case <-m.kick:
		case done := <-m.settle:
			m.reconcile(ctx)
			close(done)
		case <-t.C:
			m.checkVanished()
			m.closeIdle()
		}
	}
}

func (m *Manager) wake() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// shutdown drains every pod for ShutdownDrain (all at once), then closes
// them.
func (m *Manager) shutdown() {
	if m.cfg.ShutdownDrain <= 0 {
		m.closeAll()
		return
	}
	all := m.allPods()
	m.log.Info("draining pods before exit", "pods", len(all), "deadline", m.cfg.ShutdownDrain)
	var wg sync.WaitGroup
	for _, p := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.drainUntil(m.cfg.ShutdownDrain, nil)
		}()
	}
	wg.Wait()
	m.closeAll()
}

// allPods are the serving and the draining pods.
func (m *Manager) allPods() []*pod {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.allPodsLocked()
}

func (m *Manager) allPodsLocked() []*pod {
	all := make([]*pod, 0, len(m.pods)+len(m.draining))
	for _, p := range m.pods {
		all = append(all, p)
	}
	for p := range m.draining {
		all = append(all, p)
	}
	return all
}

func (m *Manager) closeAll() {
	m.mu.Lock()
	all := m.allPodsLocked()
	m.pods = map[string]*pod{}
	m.mu.Unlock()
	for _, p := range all {
		p.close()
	}
	for _, p := range all {
		<-p.done
	}
	m.metrics.SetPodsServing(0)
}

func (m *Manager) reconcile(ctx context.Context) {
	m.mu.Lock()
	var drain []*pod
	for key, p := range m.pods {
		if want, ok := m.desired[key]; !ok || !p.adopt(want) {
			delete(m.pods, key)
			m.draining[p] = struct{}{}
			drain = append(drain, p)
		}
	}
	for key := range m.failed {
		if _, ok := m.desired[key]; !ok {
			delete(m.failed, key)
		}
	}
	type start struct {
		key   string
		specs []listener.Spec
	}
	var starts []start
	for key, specs := range m.desired {
		if _, ok := m.pods[key]; ok || m.handedOff {
			continue
		}
		busy := false
		for d := range m.draining {
			if d.key == key {
				busy = true // its ports are still held; start once drained
			}
		}
		if !busy {
			starts = append(starts, start{key, specs})
		}
	}
	m.mu.Unlock()

	for _, p := range drain {
		m.log.Info("draining pod listeners", "pod_key", p.key, "namespace", p.namespace, "pod", p.name)
		go func() {
			p.drain(m.cfg.DrainTimeout)
			m.mu.Lock()
			delete(m.draining, p)
			m.mu.Unlock()
			m.wake()
		}()
	}
	for _, s := range starts {
		p, err := m.startPod(ctx, s.key, s.specs)
		m.mu.Lock()
		if err != nil {
			if m.failed[s.key] != err.Error() {
				m.log.Error("failed to bind pod listeners", "pod_key", s.key, "error", err)
			}
			m.failed[s.key] = err.Error()
		} else if want, ok := m.desired[s.key]; ok && p.adopt(want) {
			delete(m.failed, s.key)
			m.pods[s.key] = p
			m.log.Info("pod listeners serving", "pod_key", s.key, "namespace", p.namespace, "pod", p.name, "netns", p.netns.path)
		} else {
			p.close() // the desired state changed meanwhile
			defer m.wake()
		}
		m.mu.Unlock()
	}
	m.mu.Lock()
	m.metrics.SetPodsServing(len(m.pods))
	m.mu.Unlock()
}

// checkVanished closes the listeners of pods whose netns path is gone.
func (m *Manager) checkVanished() {
	m.mu.Lock()
	var gone []*pod
	for key, p := range m.pods {
		if p.netns.gone() {
			delete(m.pods, key)
			m.draining[p] = struct{}{}
			gone = append(gone, p)
		}
	}
	m.mu.Unlock()
	for _, p := range gone {
		m.log.Warn("pod netns vanished; closing its listeners", "pod_key", p.key, "netns", p.netns.path)
		p.close()
		go func() {
			<-p.done
			m.mu.Lock()
			delete(m.draining, p)
			m.mu.Unlock()
		}()
	}
}

// Status lists every pod the manager knows, sorted by key.
func (m *Manager) Status() []PodStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := []PodStatus{}
	for _, p := range m.pods {
		out = append(out, p.status())
	}
	for p := range m.draining {
		out = append(out, p.status())
	}
	for key, e := range m.failed {
		st := PodStatus{Key: key, State: StateFailed, Error: e}
		if specs := m.desired[key]; len(specs) > 0 {
			st.Namespace, st.Name, st.NetNS, st.UDSSocket = specs[0].Namespace, specs[0].PodName, specs[0].NetNSPath, specs[0].UDSSocket
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b PodStatus) int {
		if a.Key != b.Key {
			if a.Key < b.Key {
				return -1
			}
			return 1
		}
		return 0
	})
	return out
}

// Ready reports whether the pod with key is serving (its readiness endpoint
// answers 200).
func (m *Manager) Ready(key string) bool {
	m.mu.Lock()
	p := m.pods[key]
	m.mu.Unlock()
	return p != nil && p.ready()
}

// Close releases the manager's own netns fd and the HBONE dialer's
// connections. Call after Run returned.
func (m *Manager) Close() error {
	if m.tunnel != nil {
		_ = m.tunnel.Close()
	}
	m.pipes.close()
	m.DropInherited()
	return closeFd(m.home)
}

var errClosed = errors.New("pod closed")

func specsError(key string, specs []listener.Spec) error {
	if len(specs) == 0 {
		return fmt.Errorf("pod %q has no listeners", key)
	}
	ns := specs[0].NetNSPath
	for _, s := range specs {
		if s.NetNSPath != ns {
			return fmt.Errorf("pod %q listeners name two netns paths %q and %q: one pod has one netns", key, ns, s.NetNSPath)
		}
	}
	return nil
}
