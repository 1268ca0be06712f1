package readiness

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
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
func (p Prober) Probe(ctx context.Context, nsPath, url string, budget time.Duration) error {
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
	d := &net.Dialer{}
	client := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		Proxy:             nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c net.Conn
			// The socket is created on a thread inside the pod's netns and
			// stays there.
			err := netns.Do(func(ns.NetNS) error {
				var err error
				c, err = d.DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	var last error
	for {
		last = get(ctx, client, url, per)
		if last == nil {
			return nil
		}
		t := time.NewTimer(interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("readiness endpoint %s not serving within %s: %w", url, budget, last)
		case <-t.C:
		}
	}
}

func get(ctx context.Context, c *http.Client, url string, per time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, per)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s answered %s", url, resp.Status)
	}
	return nil
}
