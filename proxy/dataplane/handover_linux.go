package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"golang.org/x/sys/unix"

	"aether.io/node/proxy/handover"
	"aether.io/node/xds/listener"
)

// The data plane's part of the hand-over to a successor (proxy/handover,
// proxy/README.md "Hand-over to a successor"): the old manager offers a
// copy of every serving pod's listening sockets and, once the successor
// accepts on them, retires (accepts nothing, binds nothing, drains); the
// successor's manager binds a pod's listener from the inherited socket of
// the same pod, listener, network and address, in the same netns, instead
// of binding a new one.

// hboneName names the pods' HBONE listeners in the hand-over.
const hboneName = "hbone"

// Offer returns a copy of every listening socket of the serving pods.
func (m *Manager) Offer() ([]handover.Socket, error) {
	m.mu.Lock()
	pods := make([]*pod, 0, len(m.pods))
	for _, p := range m.pods {
		pods = append(pods, p)
	}
	m.mu.Unlock()
	var out []handover.Socket
	var err error
	add := func(p *pod, name, network string, a net.Addr, f interface{ File() (*os.File, error) }) {
		if err != nil {
			return
		}
		file, ferr := f.File()
		if errors.Is(ferr, net.ErrClosed) {
			return // the pod closes meanwhile: nothing to hand over
		}
		if ferr != nil {
			err = fmt.Errorf("failed to copy listener %q of pod %q: %w", name, p.key, ferr)
			return
		}
		out = append(out, handover.Socket{Pod: p.key, Name: name, Network: network, Addr: addrPort(a).String(), File: file})
	}
	for _, p := range pods {
		for _, l := range p.tcp {
			add(p, l.spec.Name, l.network, l.ln.Addr(), l.ln)
		}
		for _, u := range p.udp {
			add(p, u.name, u.network, u.conn.LocalAddr(), u.conn)
		}
		if p.hb != nil {
			for _, ln := range p.hb.lns {
				add(p, hboneName, "tcp"+familyOf(ln.Addr()), ln.Addr(), ln.(*net.TCPListener))
			}
		}
	}
	if err != nil {
		for _, s := range out {
			_ = s.File.Close()
		}
		return nil, err
	}
	return out, nil
}

func familyOf(a net.Addr) string {
	if addrPort(a).Addr().Is4() {
		return "4"
	}
	return "6"
}

// Retire stops accepting in every pod at once (the successor accepts on
// the same sockets) and binds no pod any more; the established connections
// drain when Run's context ends (ShutdownDrain).
func (m *Manager) Retire() {
	m.mu.Lock()
	m.handedOff = true
	all := m.allPodsLocked()
	m.mu.Unlock()
	for _, p := range all {
		p.draining.Store(true)
		p.stopAccepting()
		for _, l := range p.tcp {
			_ = l.ln.Close() // the readiness listener too: the successor answers
		}
	}
}

// Inherit hands the manager the sockets a predecessor passed: a pod bound
// from now on takes its listener from them (DropInherited closes the rest).
func (m *Manager) Inherit(socks []handover.Socket) {
	m.inhMu.Lock()
	defer m.inhMu.Unlock()
	for _, s := range socks {
		if old := m.inherited[s.Key()]; old != nil {
			_ = old.Close()
		}
		m.inherited[s.Key()] = s.File
	}
}

// DropInherited closes the inherited sockets no pod took (pods the agent
// no longer lists) and returns how many.
func (m *Manager) DropInherited() int {
	m.inhMu.Lock()
	defer m.inhMu.Unlock()
	n := len(m.inherited)
	for k, f := range m.inherited {
		_ = f.Close()
		delete(m.inherited, k)
	}
	return n
}

// Inherited is the number of inherited sockets no pod took yet.
func (m *Manager) Inherited() int {
	m.inhMu.Lock()
	defer m.inhMu.Unlock()
	return len(m.inherited)
}

// Settle returns once a reconcile that started after the call completed:
// every pod desired by then is bound (from inherited sockets where there
// are) and served, or failed.
func (m *Manager) Settle(ctx context.Context) error {
	done := make(chan struct{})
	select {
	case m.settle <- done:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (m *Manager) takeInherited(key string) *os.File {
	m.inhMu.Lock()
	defer m.inhMu.Unlock()
	f := m.inherited[key]
	delete(m.inherited, key)
	return f
}

// inNetNS runs fn, which binds the listeners names[i] on binds[i], on a
// thread in the pod's netns; when every one of them is inherited, no new
// socket is created and fn runs where it is (entering a netns costs more
// than the whole adoption of a socket).
func (p *pod) inNetNS(names []string, binds []listener.Bind, fn func() error) error {
	p.m.inhMu.Lock()
	all := len(p.m.inherited) > 0
	for i := 0; all && i < len(binds); i++ {
		_, all = p.m.inherited[inheritedKey(p.key, names[i], binds[i])]
	}
	p.m.inhMu.Unlock()
	if all {
		return fn()
	}
	return p.netns.do(fn)
}

func inheritedKey(pod, name string, b listener.Bind) string {
	return handover.Key(pod, name, network(b), netip.AddrPortFrom(b.Addr.Addr().Unmap(), b.Addr.Port()).String())
}

// inheritedSocket returns the inherited socket of the pod's listener name
// on b, when there is one in the pod's netns (nil: bind a new one).
func (p *pod) inheritedSocket(name string, b listener.Bind) (*os.File, error) {
	f := p.m.takeInherited(inheritedKey(p.key, name, b))
	if f == nil {
		return nil, nil
	}
	if err := handover.WithFd(f, p.netns.owns); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("inherited %s listener %q on %s: %w", network(b), name, b.Addr, err)
	}
	return f, nil
}

// owns checks that the socket fd was created in this namespace (SIOCGSKNS
// gives the socket's netns; its inode must be the one opened).
func (n *netNS) owns(fd int) error {
	nsfd, err := unix.IoctlRetInt(fd, unix.SIOCGSKNS)
	if err != nil {
		return fmt.Errorf("failed to read the socket's netns: %w", err)
	}
	defer unix.Close(nsfd)
	var st unix.Stat_t
	if err := unix.Fstat(nsfd, &st); err != nil {
		return fmt.Errorf("failed to stat the socket's netns: %w", err)
	}
	if st.Dev != n.dev || st.Ino != n.ino {
		return fmt.Errorf("socket belongs to another netns than %q", n.path)
	}
	return nil
}
