package dataplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/listener"
)

func closeFd(fd int) error { return unix.Close(fd) }

// pod is one pod's bound listeners and open connections.
type pod struct {
	m         *Manager
	key       string
	namespace string
	name      string
	specs     []listener.Spec
	ips       []netip.Addr
	netns     *netNS
	log       *slog.Logger
	dialer    net.Dialer

	ctx    context.Context
	cancel context.CancelFunc

	tcp  []*tcpListener
	udp  []*udpListener
	http []*http.Server

	draining atomic.Bool
	loops    atomic.Int32 // accept/read loops running
	want     int32        // loops when fully served

	// tcpConns counts the pod's open TCP connections (MaxConnsPerPod).
	tcpConns atomic.Int64
	// strict is the pod's inbound policy (policy_linux.go): true resets
	// plaintext on the inbound listener. Changed in place by adopt.
	strict atomic.Bool
	// gate holds the pod's declared ports for HBONEDeclaredPortsOnly
	// (declaredports_linux.go). Changed in place by adopt.
	gate portGate
	// policyLog rate-limits the pod's authorization refusal lines.
	policyLog rateLog
	// flows are the pod's open UDP flows, of both families.
	flowMu sync.Mutex
	flows  map[flowKey]*udpFlow

	mu    sync.Mutex
	conns map[closer]struct{}
	wg    sync.WaitGroup // connections and flows
	awg   sync.WaitGroup // accept and datagram loops (they add to wg)
	hwg   sync.WaitGroup // readiness HTTP servers

	closeOnce sync.Once
	done      chan struct{}

	hb *podHBONE // HBONE side (hbone_linux.go); nil without identity

	// srcRule caches, per family (IPv4, IPv6), that the divert's deliver
	// rule is in place (source_linux.go); srcLogged: the missing rule was
	// logged.
	srcRule   [2]atomic.Bool
	srcLogged atomic.Bool
}

type closer interface{ abort() }

type tcpListener struct {
	spec    listener.Spec
	ln      *net.TCPListener
	port    uint16
	network string // tcp4 or tcp6
}

func transparentControl(udp bool) func(network, address string, rc syscall.RawConn) error {
	return func(network, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			if network == "tcp6" || network == "udp6" {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
				if serr == nil && udp {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1)
				}
				return
			}
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
			if serr == nil && udp {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1)
			}
		})
		if err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("failed to set IP_TRANSPARENT: %w", serr)
		}
		return nil
	}
}

func markControl(mark uint32) func(network, address string, rc syscall.RawConn) error {
	return func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
		}); err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("failed to set SO_MARK %#x: %w", mark, serr)
		}
		return nil
	}
}

func network(b listener.Bind) string {
	n := "tcp"
	if b.UDP {
		n = "udp"
	}
	if b.Addr.Addr().Unmap().Is4() {
		return n + "4"
	}
	return n + "6"
}

// startPod opens the pod's netns and binds every listener inside it. On
// error nothing stays bound.
func (m *Manager) startPod(ctx context.Context, key string, specs []listener.Spec) (*pod, error) {
	if err := specsError(key, specs); err != nil {
		return nil, err
	}
	ns, err := openNetNS(specs[0].NetNSPath, m.home)
	if err != nil {
		return nil, err
	}
	p := &pod{
		m: m, key: key, namespace: specs[0].Namespace, name: specs[0].PodName, specs: specs,
		ips: specs[0].PodIPs, netns: ns, conns: map[closer]struct{}{}, flows: map[flowKey]*udpFlow{}, done: make(chan struct{}),
		log: m.log.With("pod_key", key, "namespace", specs[0].Namespace, "pod", specs[0].PodName),
	}
	p.dialer = net.Dialer{Timeout: m.cfg.ConnectTimeout, Control: markControl(m.cfg.BypassMark)}
	p.setPolicy(specs)
	p.setDeclaredPorts(specs)
	p.ctx, p.cancel = context.WithCancel(ctx)
	err = p.bind()
	if err == nil {
		err = p.bindHBONE(m.podSeq.Add(1))
	}
	if err != nil {
		p.close()
		<-p.done
		return nil, err
	}
	p.serve()
	return p, nil
}

func (p *pod) bind() error {
	var binds []listener.Bind
	var names []string
	for _, s := range p.specs {
		for _, b := range s.Binds {
			binds, names = append(binds, b), append(names, s.Name)
		}
	}
	return p.inNetNS(names, binds, func() error {
		for _, s := range p.specs {
			for _, b := range s.Binds {
				ln, pc, err := p.listen(s, b)
				if err != nil {
					return fmt.Errorf("failed to bind %s listener %q on %s: %w", network(b), s.Name, b.Addr, err)
				}
				if b.UDP {
					p.udp = append(p.udp, &udpListener{conn: pc.(*net.UDPConn), port: b.Addr.Port(), name: s.Name, network: network(b)})
					continue
				}
				p.tcp = append(p.tcp, &tcpListener{spec: s, ln: ln.(*net.TCPListener), port: b.Addr.Port(), network: network(b)})
			}
		}
		return nil
	})
}

// listen opens the socket of bind b of listener s: the one a predecessor
// handed over (proxy/handover) when there is one, else a new one. It runs
// in the pod's netns.
func (p *pod) listen(s listener.Spec, b listener.Bind) (net.Listener, net.PacketConn, error) {
	f, err := p.inheritedSocket(s.Name, b)
	if err != nil {
		p.log.Warn("inherited listener refused; binding a new one", "error", err.Error())
	}
	if f != nil {
		defer f.Close() // the listener holds its own copy
		if b.UDP {
			pc, err := net.FilePacketConn(f)
			return nil, pc, err
		}
		ln, err := net.FileListener(f)
		return ln, nil, err
	}
	lc := net.ListenConfig{}
	if s.Transparent {
		lc.Control = transparentControl(b.UDP)
	}
	if b.UDP {
		pc, err := lc.ListenPacket(context.Background(), network(b), b.Addr.String())
		return nil, pc, err
	}
	ln, err := lc.Listen(context.Background(), network(b), b.Addr.String())
	return ln, nil, err
}

// serve starts one loop per socket.
func (p *pod) serve() {
	p.want = int32(len(p.tcp) + len(p.udp) + p.hboneLoops())
	p.serveHBONE()
	for _, l := range p.tcp {
		p.loops.Add(1)
		switch l.spec.Role {
		case listener.RoleOutbound:
			srv := &http.Server{Handler: p.readinessHandler(), ReadHeaderTimeout: 5 * time.Second}
			p.http = append(p.http, srv)
			p.hwg.Add(1)
			go func() {
				defer p.hwg.Done()
				defer p.loops.Add(-1)
				_ = srv.Serve(l.ln)
			}()
		default:
			p.awg.Add(1)
			go func() {
				defer p.awg.Done()
				defer p.loops.Add(-1)
				p.acceptLoop(l)
			}()
		}
	}
	for _, u := range p.udp {
		p.awg.Add(1)
		p.loops.Add(1)
		go func() {
			defer p.awg.Done()
			defer p.loops.Add(-1)
			p.udpLoop(u)
		}()
	}
}

func (p *pod) ready() bool {
	return !p.draining.Load() && p.loops.Load() == p.want && p.ctx.Err() == nil
}

func (p *pod) readinessHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+listener.ReadyPath, func(w http.ResponseWriter, _ *http.Request) {
		if p.ready() {
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte("ready\n"))
			return
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte("draining\n"))
	})
	return mux
}

func (p *pod) acceptLoop(l *tcpListener) {
	var backoff time.Duration
	for {
		c, err := l.ln.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.ctx.Err() != nil {
				return
			}
			// EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: back off and retry.
			if backoff == 0 {
				backoff = 5 * time.Millisecond
			} else if backoff < time.Second {
				backoff *= 2
			}
			p.log.Warn("accept failed", "listener", l.spec.Name, "error", err)
			select {
			case <-time.After(backoff):
				continue
			case <-p.ctx.Done():
				return
			}
		}
		backoff = 0
		release, limit := p.admitTCP()
		if limit != "" {
			p.m.metrics.LimitHit(limit)
			p.m.metrics.Failed(limit)
			p.refuseAtLimit(c, l, limit)
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer release()
			switch l.spec.Role {
			case listener.RoleCapture:
				p.proxyTCP(c, l)
			default:
				p.serveInbound(c, l)
			}
		}()
	}
}

// refuseAtLimit resets a connection accepted over a connection cap
// (limit), counted as the side its listener is: the capture listener's
// source, the inbound listener's destination.
func (p *pod) refuseAtLimit(c *net.TCPConn, l *tcpListener, limit string) {
	src, dst := addrPort(c.RemoteAddr()), addrPort(c.LocalAddr())
	var info telemetry.ConnInfo
	if l.spec.Role == listener.RoleCapture {
		info = p.sourceInfo(src, dst, p.lookup(dst.Addr()))
	} else {
		info = p.destinationInfo(src, dst)
	}
	info.Limit = limit
	reset(c)
	p.m.metrics.Refused(info, telemetry.ReasonLimit, fmt.Errorf("failed to admit a connection of pod %q: %s limit", p.key, limit))
}

// track registers an open connection or flow; false when the pod is closing.
func (p *pod) track(c closer) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *pod) untrack(c closer) {
	p.mu.Lock()
	if p.conns != nil {
		delete(p.conns, c)
	}
	p.mu.Unlock()
}

func (p *pod) openConns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// stopAccepting closes the capture, UDP and inbound sockets; the readiness
// listener keeps answering (503 while draining).
func (p *pod) stopAccepting() {
	for _, l := range p.tcp {
		if l.spec.Role != listener.RoleOutbound {
			_ = l.ln.Close()
		}
	}
	for _, u := range p.udp {
		_ = u.conn.Close()
	}
	p.stopHBONE()
}

// drain stops accepting, lets open connections finish within timeout,
// aborts the rest, then closes everything.
func (p *pod) drain(timeout time.Duration) { p.drainUntil(timeout, p.done) }

// drainUntil stops accepting, ends the UDP flows, and waits for the open
// connections until they end, timeout passes or abort closes; then it closes
// the pod.
func (p *pod) drainUntil(timeout time.Duration, abort <-chan struct{}) {
	p.draining.Store(true)
	p.stopAccepting()
	// UDP flows have no end of their own: they stop with the listeners.
	for _, f := range connsOf[*udpFlow](p) {
		f.abort()
	}
	finished := make(chan struct{})
	go func() {
		p.awg.Wait() // no connection is added after this
		p.wg.Wait()
		close(finished)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	reason := telemetry.ReasonPodClosed
	select {
	case <-finished:
	case <-t.C:
		p.log.Warn("drain deadline passed; closing open connections", "open", p.openConns())
		reason = telemetry.ReasonDrainDeadline
		p.finishConns(finished)
	case <-abort:
	}
	p.closeWith(reason)
	<-p.done
}

// finisher is a connection that can end cleanly (FIN, not reset) at a
// drain deadline.
type finisher interface{ finish() }

// finishConns ends the pod's open TCP connections cleanly and waits until
// they closed (finished) or finishLinger and a margin passed; closeWith
// then aborts what is left.
func (p *pod) finishConns(finished <-chan struct{}) {
	fs := connsOf[finisher](p)
	if len(fs) == 0 {
		return
	}
	for _, f := range fs {
		f.finish()
	}
	t := time.NewTimer(finishLinger + 250*time.Millisecond)
	defer t.Stop()
	for len(connsOf[finisher](p)) > 0 {
		select {
		case <-finished:
			return
		case <-t.C:
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// connsOf returns the pod's open connections and flows that are a T.
func connsOf[T any](p *pod) []T {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []T
	for c := range p.conns {
		if t, ok := c.(T); ok {
			out = append(out, t)
		}
	}
	return out
}

// close aborts everything at once; done is closed when every goroutine of
// the pod has ended.
func (p *pod) close() { p.closeWith(telemetry.ReasonPodClosed) }

// closeWith is close with the reason the open connections' telemetry
// gives.
func (p *pod) closeWith(reason telemetry.CloseReason) {
	p.closeOnce.Do(func() {
		p.draining.Store(true)
		p.cancel()
		p.stopAccepting()
		for _, l := range p.tcp {
			_ = l.ln.Close()
		}
		for _, s := range p.http {
			_ = s.Close()
		}
		p.mu.Lock()
		conns := p.conns
		p.conns = nil
		p.mu.Unlock()
		for c := range conns {
			abortFor(c, reason)
		}
		p.closeHBONE()
		go func() {
			p.awg.Wait()
			p.hwg.Wait()
			p.wg.Wait()
			_ = p.netns.close()
			close(p.done)
		}()
	})
}

func (p *pod) status() PodStatus {
	st := PodStatus{Key: p.key, Namespace: p.namespace, Name: p.name, NetNS: p.netns.path, State: StateServing, Conns: p.openConns()}
	if len(p.specs) > 0 {
		st.UDSSocket = p.specs[0].UDSSocket
	}
	if d := p.gate.ports.Load(); d != nil {
		st.DeclaredPortsKnown, st.DeclaredTCPPorts = d.known, d.tcp
	}
	p.flowMu.Lock()
	st.UDPFlows = len(p.flows)
	p.flowMu.Unlock()
	if p.draining.Load() {
		st.State = StateDraining
	}
	return st
}

// isLoop reports a connection whose original destination is one of the
// pod's own listeners (a direct connection to the capture port, which was
// not diverted): forwarding it would connect to itself forever.
func (p *pod) isLoop(dst netip.AddrPort, listenPort uint16) bool {
	if dst.Port() != listenPort {
		return false
	}
	a := dst.Addr().Unmap()
	if a.IsLoopback() || a.IsUnspecified() {
		return true
	}
	for _, ip := range p.ips {
		if ip.Unmap() == a {
			return true
		}
	}
	return false
}

func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}
