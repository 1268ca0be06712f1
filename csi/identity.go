package csi

import (
	"context"
	"fmt"
	"os"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"aether.io/node/pkg/meshcontract"
)

// GetPluginInfo returns the driver's name and version.
func (d *Driver) GetPluginInfo(context.Context, *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	return &csipb.GetPluginInfoResponse{Name: meshcontract.CSIDriver, VendorVersion: d.cfg.Version}, nil
}

// GetPluginCapabilities reports no Controller service and no topology: the
// driver is node-only.
func (d *Driver) GetPluginCapabilities(context.Context, *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	return &csipb.GetPluginCapabilitiesResponse{}, nil
}

// Probe is ready while <uds-csi-root> is a directory (Serve creates it);
// otherwise it answers not ready and logs why.
func (d *Driver) Probe(ctx context.Context, _ *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	fi, err := os.Stat(d.cfg.Root)
	if err == nil && !fi.IsDir() {
		err = fmt.Errorf("it is a %s, not a directory", fi.Mode().Type())
	}
	if err != nil {
		d.log.WarnContext(ctx, "not ready", "uds_csi_root", d.cfg.Root, "error", err)
		return &csipb.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
	}
	return &csipb.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
