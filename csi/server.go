package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"aether.io/node/pkg/unixsock"
)

// Listen opens the driver's endpoint with the unixsock policy, relaxed for
// kubelet's plugin directory (kubelet and hostPath DirectoryOrCreate make it
// 0750 or 0755; it must not be writable by group or others).
func Listen(endpoint string) (net.Listener, error) {
	return unixsock.Listen(endpoint, unixsock.AllowReadableDir())
}

// Serve creates <uds-csi-root> (RootMode) when missing, then serves the
// Identity and Node services on l until ctx ends and stops gracefully. l is
// closed when Serve returns.
func (d *Driver) Serve(ctx context.Context, l net.Listener) error {
	if err := os.MkdirAll(d.cfg.Root, RootMode); err != nil {
		_ = l.Close()
		return fmt.Errorf("failed to create uds csi root %q: %w", d.cfg.Root, err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(d.logCall))
	csipb.RegisterIdentityServer(srv, d)
	csipb.RegisterNodeServer(srv, d)
	d.log.Info("serving", "endpoint", l.Addr().String(), "version", d.cfg.Version, "uds_csi_root", d.cfg.Root, "node", d.cfg.NodeName)
	return serveGRPC(ctx, srv, l)
}

// serveGRPC serves srv on l until ctx ends, then stops it gracefully (which
// closes l).
func serveGRPC(ctx context.Context, srv *grpc.Server, l net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	select {
	case err := <-errc:
		return fmt.Errorf("failed to serve %q: %w", l.Addr().String(), err)
	case <-ctx.Done():
	}
	srv.GracefulStop()
	if err := <-errc; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("failed to serve %q: %w", l.Addr().String(), err)
	}
	return nil
}

// Run serves the driver on cfg.Endpoint and, unless cfg.RegistrationDir is
// empty, kubelet's plugin registration on <RegistrationDir>/<driver>-reg.sock,
// until ctx ends or one of them fails (which stops the other). Both sockets
// are removed when Run returns; the registration socket is opened after the
// CSI socket, so kubelet never finds the driver before its endpoint listens.
func Run(ctx context.Context, cfg Config, d *Driver, log *slog.Logger) error {
	l, err := Listen(cfg.Endpoint)
	if err != nil {
		return err
	}
	if cfg.RegistrationDir == "" {
		return d.Serve(ctx, l)
	}
	rl, err := Listen(filepath.Join(cfg.RegistrationDir, RegistrationSocket))
	if err != nil {
		_ = l.Close()
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	endpoint := cfg.KubeletEndpoint
	if endpoint == "" {
		endpoint = cfg.Endpoint
	}
	reg := NewRegistration(endpoint, log)
	errc := make(chan error, 2)
	go func() { errc <- d.Serve(ctx, l); cancel() }()
	go func() { errc <- reg.Serve(ctx, rl); cancel() }()
	return errors.Join(<-errc, <-errc)
}

// logCall logs every call with its gRPC code; failures at warn.
func (d *Driver) logCall(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	lvl := slog.LevelDebug
	if err != nil {
		lvl = slog.LevelWarn
	}
	d.log.Log(ctx, lvl, "csi call", "method", info.FullMethod, "code", status.Code(err).String(), "error", err)
	return resp, err
}
