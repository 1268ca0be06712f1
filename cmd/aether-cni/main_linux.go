package main

import (
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"

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
	wrap := func(f func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
		return func(a *skel.CmdArgs) error {
			if err := f(a); err != nil {
				return cniutil.AsCNIError(err)
			}
			return nil
		}
	}
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    wrap(p.Add),
		Del:    wrap(p.Del),
		Check:  wrap(p.Check),
		Status: wrap(p.Status),
		GC:     wrap(p.GC),
	}, version.PluginSupports("0.4.0", "1.0.0", "1.1.0"), "aether-cni: chained mesh CNI plugin (aether-agent registration, readiness probe, transparent-capture divert)")
}
