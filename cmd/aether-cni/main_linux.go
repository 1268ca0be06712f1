package main

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"time"

	"aether.io/node/meshcni"
	"aether.io/node/meshcni/pin"
	"aether.io/node/pkg/cniutil"
)

func init() {
	// Namespace switches (ns.Do) must happen on a locked thread.
	runtime.LockOSThread()
}

func main() {
	started := time.Now()
	if helper, err := pin.RunHelperFromEnv(); helper {
		if err != nil {
			fmt.Fprintln(os.Stderr, "aether-cni delayed unpin:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	p := meshcni.New(started)
	os.Exit(cniutil.PluginMain(p.Verbs(), meshcni.SupportedVersions, meshcni.About, slog.New(slog.NewTextHandler(os.Stderr, nil))))
}
