package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"aether.io/node/csi"
)

// version is reported by GetPluginInfo (set with -ldflags -X main.version=...).
var version = "dev"

func main() {
	cfg, err := csi.ParseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "aether-csi:", err)
		os.Exit(2)
	}
	cfg.Version = version
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	d, err := csi.New(cfg, csi.NewMounter(), log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "aether-csi:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := csi.Run(ctx, cfg, d, log); err != nil {
		log.Error("driver stopped", "error", err)
		os.Exit(1)
	}
}
