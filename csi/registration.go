package csi

import (
	"context"
	"log/slog"
	"net"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"aether.io/node/pkg/meshcontract"
)

// RegistrationSocket is the name of the registration socket in kubelet's
// plugins_registry directory: <driver>-reg.sock, as node-driver-registrar
// names it.
const RegistrationSocket = meshcontract.CSIDriver + "-reg.sock"

// SupportedVersion is the CSI spec version announced to kubelet
// (node-driver-registrar announces the same): kubelet speaks CSI v1 to the
// driver's endpoint.
const SupportedVersion = "1.0.0"

// Registration is kubelet's plugin registration service
// (pluginregistration.v1) for csi.aether.io: kubelet's plugin watcher finds
// its socket in plugins_registry, asks GetInfo for the driver's name and
// CSI endpoint, registers the driver (calling NodeGetInfo on that endpoint)
// and reports the outcome with NotifyRegistrationStatus.
type Registration struct {
	registerapi.UnimplementedRegistrationServer

	endpoint string
	log      *slog.Logger
}

// NewRegistration returns the registration service announcing endpoint,
// the CSI socket's path as kubelet sees it; it does no I/O.
func NewRegistration(endpoint string, log *slog.Logger) *Registration {
	return &Registration{endpoint: endpoint, log: log}
}

// GetInfo tells kubelet what registers: a CSI plugin named csi.aether.io,
// served at the endpoint, speaking CSI SupportedVersion.
func (r *Registration) GetInfo(ctx context.Context, _ *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	r.log.DebugContext(ctx, "kubelet asked for the plugin info", "endpoint", r.endpoint)
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              meshcontract.CSIDriver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{SupportedVersion},
	}, nil
}

// NotifyRegistrationStatus logs kubelet's verdict. A refusal is logged at
// error and the driver keeps serving: kubelet retries when the socket is
// created again (a restart), and the CSI socket stays usable by whoever
// registers it another way.
func (r *Registration) NotifyRegistrationStatus(ctx context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if s.GetPluginRegistered() {
		r.log.InfoContext(ctx, "registered with kubelet", "driver", meshcontract.CSIDriver, "endpoint", r.endpoint)
	} else {
		r.log.ErrorContext(ctx, "kubelet refused the registration", "driver", meshcontract.CSIDriver, "endpoint", r.endpoint, "error", s.GetError())
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// Serve serves the registration service on l until ctx ends, then stops
// gracefully. l is closed (and its socket removed) when Serve returns, so
// kubelet deregisters the driver.
func (r *Registration) Serve(ctx context.Context, l net.Listener) error {
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, r)
	r.log.Info("serving kubelet plugin registration", "socket", l.Addr().String(), "endpoint", r.endpoint)
	return serveGRPC(ctx, srv, l)
}
