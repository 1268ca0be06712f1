// Package ctl holds the aetherctl subcommands.
package ctl

import (
	"context"
	"fmt"
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

// RunPolicies is `aetherctl policies`: every workload with the
// authorization policies that select it, then every policy served.
func RunPolicies(ctx context.Context, args []string, stdout io.Writer) error {
	return workloadclient.RunPolicies(ctx, args, stdout)
}

// RunPolicy is `aetherctl policy check <src ns/pod> <dst ns/pod>[:port]`:
// the decision the destination's proxy makes, and the policy that made it.
func RunPolicy(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 || args[0] != "check" {
		return fmt.Errorf("invalid aetherctl policy %q: the one subcommand is check <src ns/pod> <dst ns/pod>[:port]", args)
	}
	return workloadclient.RunPolicyCheck(ctx, args[1:], stdout)
}
