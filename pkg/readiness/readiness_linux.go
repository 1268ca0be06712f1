package readiness

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
)

// Prober probes readiness endpoints inside network namespaces.
type Prober struct {
	// Interval is the pause between attempts (100 ms when zero).
	Interval time.Duration
	// PerRequest bounds one attempt (1 s when zero).
	PerRequest time.Duration
}

// Probe GETs url from inside the netns at nsPath until a 200 or until
// budget elapses (or ctx ends), and returns the last failure.
func (p Prober) Probe(ctx context.Context, nsPath, rawURL string, budget time.Duration) error {
	interval, per := p.Interval, p.PerRequest
	if interval <= 0 {
		interval = 100 * time.Millisecond
	}
	if per <= 0 {
		per = time.Second
	}
	netns, err := ns.GetNS(nsPath)
	if err != nil {
		return fmt.Errorf("failed to open pod netns %q: %w", nsPath, err)
	}
	defer func() { _ = netns.Close() }()
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return fmt.Errorf("invalid readiness URL %q: want http://host:port/path", rawURL)
	}
	d := &net.Dialer{}
	dial := func(ctx context.Context) (net.Conn, error) {
		var c net.Conn
		// The socket is created on a thread inside the pod's netns and
		// stays there.
		err := netns.Do(func(ns.NetNS) error {
			var err error
			c, err = d.DialContext(ctx, "tcp", u.Host)
			return err
		})
		return c, err
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	var last error
	for {
		last = get(ctx, dial, u, per)
		if last == nil {
			return nil
		}
		t := time.NewTimer(interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("readiness endpoint %s not serving within %s: %w", rawURL, budget, last)
		case <-t.C:
		}
	}
}

// get sends one HTTP/1.1 GET of u on a new connection and reads the status
// line: 200 is serving, anything else is the error. It is written out
// rather than done with net/http, whose packages (crypto/tls and x509
// included) would cost every plugin exec ~2.5 ms of start-up
// (meshcni/README.md, "Start-up").
func get(ctx context.Context, dial func(context.Context) (net.Conn, error), u *url.URL, per time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, per)
	defer cancel()
	c, err := dial(ctx)
	if err != nil {
		return fmt.Errorf("failed to connect to %s: %w", u.Host, err)
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: aether-cni\r\nConnection: close\r\n\r\n", u.RequestURI(), u.Host); err != nil {
		return fmt.Errorf("failed to send GET %s: %w", u, err)
	}
	line, err := bufio.NewReaderSize(c, 256).ReadSlice('\n')
	if err != nil {
		return fmt.Errorf("failed to read the answer to GET %s: %w", u, err)
	}
	proto, status, _ := strings.Cut(strings.TrimRight(string(line), "\r\n"), " ")
	if !strings.HasPrefix(proto, "HTTP/1.") || len(status) < 3 {
		return fmt.Errorf("GET %s answered %q, not HTTP/1.x", u, line)
	}
	if code, _, _ := strings.Cut(status, " "); code != "200" {
		return fmt.Errorf("GET %s answered %s", u, status)
	}
	return nil
}
