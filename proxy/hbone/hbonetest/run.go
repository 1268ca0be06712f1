package hbonetest

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"aether.io/node/proxy/hbone"
)

// RunServer serves an hbone.Server for cfg on a loopback listener and shuts
// it down when the test ends (a shutdown a test already did with a canceled
// context is not an error).
func RunServer(tb testing.TB, cfg hbone.ServerConfig) (*hbone.Server, netip.AddrPort) {
	tb.Helper()
	srv, err := hbone.NewServer(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
			tb.Errorf("failed to shut down hbone server: %v", err)
		}
		if err := <-done; err != nil {
			tb.Errorf("failed to serve hbone: %v", err)
		}
	})
	return srv, l.Addr().(*net.TCPAddr).AddrPort()
}

// NewDialer returns an hbone.Dialer for certs, closed when the test ends.
func NewDialer(tb testing.TB, certs hbone.Certs) *hbone.Dialer {
	tb.Helper()
	d, err := hbone.NewDialer(hbone.DialerConfig{Certs: certs})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = d.Close() })
	return d
}
