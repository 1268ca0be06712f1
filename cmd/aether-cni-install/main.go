// Command aether-cni-install runs as the DaemonSet's install container and
// stays as a sidecar: it copies aether-cni (and optionally eni-vlan) into
// the host's CNI bin dir, chains aether-cni onto the primary network
// configuration, repairs the chain until SIGTERM, then uninstalls, unless
// --uninstall-on-exit (auto: its DaemonSet stays, a rolling update) keeps
// them. See cniinstall/README.md.
//
// Exit codes: 0 stopped after SIGTERM/SIGINT (uninstalled, or kept by
// --uninstall-on-exit), 1 install, watch or uninstall failed, 2 invalid
// flags or environment.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"aether.io/node/cniinstall"
)

func main() {
	opts, err := cniinstall.ParseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "aether-cni-install:", err)
		os.Exit(2)
	}
	log, err := cniinstall.NewLogger(os.Stderr, opts.LogLevel)
	if err != nil {
		fmt.Fprintln(os.Stderr, "aether-cni-install:", err)
		os.Exit(2)
	}
	if opts.Config.UninstallOnExit == cniinstall.UninstallAuto {
		owner, err := cniinstall.InClusterOwner(os.Getenv, cniinstall.ServiceAccountDir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "aether-cni-install:", err)
			os.Exit(2)
		}
		if owner != nil {
			opts.Config.Owner = owner
		}
	}
	inst, err := cniinstall.New(opts.Config, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "aether-cni-install:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := inst.Run(ctx); err != nil {
		log.Error("aether-cni-install failed", "error", err.Error())
		os.Exit(1)
	}
}
