package multinode

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// etcdProxy is a TCP proxy between one agent and the etcd members: one
// listener per member in the fabric namespace, each forwarding to its
// member. It can add a latency to every chunk in both directions (this
// kernel has no sch_netem; see README.md) and cut the agent off etcd (every
// connection closed, new ones closed at once: a watch outage).
type etcdProxy struct {
	lns  []net.Listener
	dial func(ctx context.Context, addr string) (net.Conn, error)

	mu    sync.Mutex
	delay time.Duration
	down  bool
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// newEtcdProxy listens on fabricIP:basePort+i for member i of c; t.Cleanup
// closes it and joins every goroutine.
func newEtcdProxy(t *testing.T, c *cluster, basePort int) *etcdProxy {
	t.Helper()
	p := &etcdProxy{dial: c.dial, conns: map[net.Conn]struct{}{}}
	for i, m := range c.members {
		var ln net.Listener
		c.fabric.MustDo(t, func() error {
			var err error
			ln, err = net.Listen("tcp", net.JoinHostPort(fabricIP, fmt.Sprint(basePort+i)))
			return err
		})
		p.lns = append(p.lns, ln)
		upstream := net.JoinHostPort(m.ip, fmt.Sprint(clientPort))
		p.wg.Add(1)
		go p.serve(ln, upstream)
	}
	t.Cleanup(p.close)
	return p
}

// endpoints are the agent's etcd client URLs, one per member.
func (p *etcdProxy) endpoints() []string {
	var out []string
	for _, ln := range p.lns {
		out = append(out, "http://"+ln.Addr().String())
	}
	return out
}

// setDelay sets the latency added to every chunk from now on.
func (p *etcdProxy) setDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// cut closes every connection and refuses new ones until restore.
func (p *etcdProxy) cut() {
	p.mu.Lock()
	p.down = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
}

// restore accepts connections again.
func (p *etcdProxy) restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

func (p *etcdProxy) close() {
	for _, ln := range p.lns {
		_ = ln.Close()
	}
	p.cut()
	p.wg.Wait()
}

// track registers conns; it reports false (and closes them) when the
// proxy is cut.
func (p *etcdProxy) track(conns ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		for _, c := range conns {
			_ = c.Close()
		}
		return false
	}
	for _, c := range conns {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *etcdProxy) untrack(conns ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range conns {
		delete(p.conns, c)
		_ = c.Close()
	}
}

func (p *etcdProxy) serve(ln net.Listener, upstream string) {
	defer p.wg.Done()
	for {
		down, err := ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			up, err := p.dial(ctx, upstream)
			cancel()
			if err != nil {
				_ = down.Close()
				return
			}
			if !p.track(down, up) {
				return
			}
			var pipes sync.WaitGroup
			pipes.Add(2)
			go func() { defer pipes.Done(); p.pipe(up, down); p.untrack(down, up) }()
			go func() { defer pipes.Done(); p.pipe(down, up); p.untrack(down, up) }()
			pipes.Wait()
		}()
	}
}

// chunk is one read, due for writing at due.
type chunk struct {
	b   []byte
	due time.Time
}

// pipe copies src to dst, each chunk written the current delay after it
// was read (chunks keep their order; the delay does not add up).
func (p *etcdProxy) pipe(dst io.Writer, src io.Reader) {
	q := make(chan chunk, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c := range q {
			time.Sleep(time.Until(c.due))
			if _, err := dst.Write(c.b); err != nil {
				for range q {
				}
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			d := p.delay
			p.mu.Unlock()
			q <- chunk{b: append([]byte(nil), buf[:n]...), due: time.Now().Add(d)}
		}
		if err != nil { // EOF, a reset or a cut: the pipe ends
			break
		}
	}
	close(q)
	<-done
}
