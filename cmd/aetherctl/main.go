// Command aetherctl is the aether operator CLI: it reads the node agent's
// state and follows aether-proxy's connection events. Each subcommand
// lives in package ctl.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"aether.io/node/ctl"
)

type command struct {
	run  func(ctx context.Context, args []string, stdout io.Writer) error
	help string
}

var commands = map[string]command{
	"pods":      {ctl.RunPods, "list the agent's pod records (managed, how and since when enrolled, terminating, registered, uncaptured, UDS)"},
	"pod":       {ctl.RunPod, "show one pod's records in detail: pod <namespace>/<name>"},
	"workloads": {ctl.RunWorkloads, "list the agent's istio.workload.Workload resources over xDS"},
	"services":  {ctl.RunServices, "list the Services of workload discovery: VIPs, ports and endpoints"},
	"policies":  {ctl.RunPolicies, "list each workload's authorization policies, then every policy served"},
	"policy":    {ctl.RunPolicy, "policy check <src ns/pod> <dst ns/pod>[:port]: the destination proxy's decision and its policy"},
	"flows":     {ctl.RunFlows, "follow the node's connection events from aether-proxy as they happen (--pod, --namespace, --denied, --service)"},
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: aetherctl <command> [flags] [args]\n\nCommands:")
	for _, n := range []string{"pods", "pod", "workloads", "services", "policies", "policy", "flows"} {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].help)
	}
	fmt.Fprintln(w, "\nRun 'aetherctl <command> --help' for a command's flags.")
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage(os.Stdout)
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	c, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "aetherctl: unknown command %q\n", os.Args[1])
		usage(os.Stderr)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := c.run(ctx, os.Args[2:], os.Stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "aetherctl:", err)
		os.Exit(1)
	}
}
