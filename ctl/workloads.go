// Package ctl holds the aetherctl subcommands.
package ctl

import (
	"context"
	"io"

	workloadclient "aether.io/node/xds/workload/client"
)

// RunWorkloads is `aetherctl workloads`: a delta xDS client of the agent's
// istio.workload.Workload resources that prints a table or JSON, and with
// --watch streams changes. Flags: --xds-socket, --xds-address, -o, --watch.
func RunWorkloads(ctx context.Context, args []string, stdout io.Writer) error {
	return workloadclient.Run(ctx, args, stdout)
}

// RunServices is `aetherctl services`: the Services of the agent's
// workload discovery (istio.workload.Address) with their VIPs, ports and
// endpoints. Flags: --xds-socket, --xds-address, -o.
func RunServices(ctx context.Context, args []string, stdout io.Writer) error {
	return workloadclient.RunServices(ctx, args, stdout)
}
