package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/handover"
	"aether.io/node/xds/adsclient"
)

// The proxy's hand-over (proxy/README.md "Hand-over to a successor"): a
// starting proxy takes the running one's listening sockets (takeOver),
// serves on them once synced with the agent, then acknowledges; the old
// proxy, acknowledged, accepts nothing and drains (Commit, then Run ends).

// DefaultHandoverSocket is the hand-over socket in the proxy's own run dir
// (the flows socket's, a hostPath only aether-proxy mounts, so the old and
// the new proxy pod of a node share it).
const DefaultHandoverSocket = flowapi.DefaultSocketDir + "/handover.sock"

// DefaultHandoverTimeout bounds a successor's sync with the agent before
// its ack; past it the successor gives up and the old proxy serves on.
const DefaultHandoverTimeout = 30 * time.Second

// takeOver asks a running predecessor for its sockets: nil (and no error)
// when there is none.
func (p *Proxy) takeOver(ctx context.Context) (*handover.Session, error) {
	if p.cfg.HandoverSocket == "" {
		return nil, nil
	}
	started := time.Now()
	s, err := handover.Take(ctx, p.cfg.HandoverSocket)
	if errors.Is(err, handover.ErrNoPredecessor) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	for _, e := range s.Rejected {
		p.log.Warn("handed-over socket refused; it is bound anew after the hand-over", "error", e.Error())
	}
	var pods []handover.Socket
	for _, sock := range s.Sockets {
		if sock.Pod == "" {
			p.own[sock.Name] = sock
			continue
		}
		pods = append(pods, sock)
	}
	p.Manager.Inherit(pods)
	p.log.Info("took over the running proxy's listeners", "sockets", len(s.Sockets), "refused", len(s.Rejected), "took", time.Since(started).String())
	return s, nil
}

// handover completes the take-over of sess (when there is one): once the
// xDS state is synced and every pod is served, the old proxy is told to
// stop accepting. Then it serves the hand-over socket for this proxy's own
// successor, and ends the proxy (stop, which drains) once one took over.
func (p *Proxy) handover(ctx context.Context, sess *handover.Session, stop context.CancelFunc) error {
	if sess != nil {
		var steps handoverSteps
		err := p.ackTakeOver(ctx, sess, &steps)
		sess.Close()
		if err != nil {
			return err
		}
		p.log.Info("hand-over done: the old proxy accepts nothing", "sync", steps.sync.String(), "serve", steps.serve.String(), "ack", steps.ack.String(), "unused", p.Manager.DropInherited())
	}
	ln, err := handover.Listen(p.cfg.HandoverSocket)
	if err != nil {
		// Serving goes on; only a successor's take-over is lost (it binds
		// its own listeners once this proxy stopped).
		p.log.Error("no hand-over socket: a successor cannot take over this proxy's listeners", "error", err.Error())
		return nil
	}
	if err := handover.Serve(ctx, ln, p, handover.DefaultAckTimeout, p.log.With("component", "handover")); err != nil {
		return nil // ctx ended: the proxy stops anyway
	}
	p.log.Info("handed over to a successor; draining", "deadline", p.cfg.Dataplane.ShutdownDrain.String())
	stop()
	return nil
}

// handoverSteps are how long a take-over's steps took, for the log.
type handoverSteps struct{ sync, serve, ack time.Duration }

func (p *Proxy) ackTakeOver(ctx context.Context, sess *handover.Session, steps *handoverSteps) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.HandoverTimeout)
	defer cancel()
	t := time.Now()
	lap := func(d *time.Duration) { *d, t = time.Since(t), time.Now() }
	for _, c := range []*adsclient.Client{p.XDS, p.LDS} {
		if c == nil {
			continue
		}
		select {
		case <-c.Synced():
		case <-ctx.Done():
			return fmt.Errorf("failed to sync with the agent before the hand-over (the old proxy serves on): %w", ctx.Err())
		}
	}
	lap(&steps.sync)
	if err := p.Manager.Settle(ctx); err != nil {
		return fmt.Errorf("failed to serve the pods before the hand-over (the old proxy serves on): %w", err)
	}
	lap(&steps.serve)
	err := sess.Ack(ctx)
	lap(&steps.ack)
	return err
}

// Offer is handover.Offerer: every pod's listening sockets and the admin
// and metrics listeners.
func (p *Proxy) Offer() ([]handover.Socket, error) {
	socks, err := p.Manager.Offer()
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	own := map[string]net.Listener{"admin": p.adminLn, "metrics": p.metricsLn, "flows": p.flowsLn}
	p.mu.Unlock()
	for name, ln := range own {
		s, err := ownSocket(name, ln)
		if err != nil {
			for _, s := range socks {
				_ = s.File.Close()
			}
			return nil, err
		}
		if s.File != nil {
			socks = append(socks, s)
		}
	}
	return socks, nil
}

// ownSocket is the hand-over socket of one of the proxy's own listeners
// (none when it does not listen).
func ownSocket(name string, ln net.Listener) (handover.Socket, error) {
	s := handover.Socket{Name: name}
	var err error
	switch l := ln.(type) {
	case *net.TCPListener:
		a := l.Addr().(*net.TCPAddr).AddrPort()
		s.Network, s.Addr = "tcp6", netip.AddrPortFrom(a.Addr().Unmap(), a.Port()).String()
		if a.Addr().Unmap().Is4() {
			s.Network = "tcp4"
		}
		s.File, err = l.File()
	case *net.UnixListener:
		s.Network, s.Addr = "unix", l.Addr().String()
		s.File, err = l.File()
	default:
		return s, nil
	}
	if err != nil {
		return s, fmt.Errorf("failed to copy the %s listener: %w", name, err)
	}
	return s, nil
}

// Commit is handover.Offerer: no pod accepts any more. The admin, metrics
// and flows listeners stay served until this proxy exits (the successor
// serves them too, on the same sockets); the flows socket's path, the
// successor's now too, is no longer removed at exit.
func (p *Proxy) Commit() {
	p.Manager.Retire()
	p.mu.Lock()
	if ul, ok := p.flowsLn.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	p.mu.Unlock()
}

// inheritedOwn returns the listener a predecessor handed over as name on
// address (any address for port 0), or nil.
func (p *Proxy) inheritedOwn(name, address string) net.Listener {
	if s, ok := p.own[name]; ok {
		delete(p.own, name)
		defer s.File.Close()
		if s.Addr == address || sameAddress(address, s.Addr) {
			ln, err := net.FileListener(s.File)
			if err == nil {
				return ln
			}
			p.log.Warn("inherited listener unusable; binding a new one", "listener", name, "error", err.Error())
		}
	}
	return nil
}

// listenOwn opens one of the proxy's own TCP listeners (admin, metrics):
// the predecessor's socket when it handed one over, else a new one.
func (p *Proxy) listenOwn(name, address string) (net.Listener, error) {
	if ln := p.inheritedOwn(name, address); ln != nil {
		return ln, nil
	}
	return net.Listen("tcp", address)
}

// sameAddress reports whether the configured address names the bound one.
func sameAddress(configured, bound string) bool {
	b, err := netip.ParseAddrPort(bound)
	if err != nil {
		return false
	}
	ta, err := net.ResolveTCPAddr("tcp", configured) // a name: "localhost:18090"
	if err != nil {
		return false
	}
	c := ta.AddrPort()
	same := c.Addr().Unmap() == b.Addr().Unmap() || (!c.Addr().IsValid() && b.Addr().IsUnspecified()) // ":18090"
	return same && (c.Port() == 0 || c.Port() == b.Port())
}

// closeOwn closes the inherited own sockets no listener took.
func (p *Proxy) closeOwn() {
	for name, s := range p.own {
		_ = s.File.Close()
		delete(p.own, name)
	}
}
