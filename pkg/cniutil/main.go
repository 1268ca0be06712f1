package cniutil

import (
	"log/slog"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
)

// Verbs are a plugin's CNI verbs; a nil verb is one the plugin does not
// implement (skel answers it as the spec says). VERSION is answered by
// PluginMain from its PluginInfo.
type Verbs struct {
	// Add, Del, Check, Status and GC are CNI ADD, DEL, CHECK, STATUS, GC.
	Add, Del, Check, Status, GC func(*skel.CmdArgs) error
}

// Funcs returns v as skel callbacks, each mapping its error to a CNI error
// code with AsCNIError: the one plugin boundary of this module.
func Funcs(v Verbs) skel.CNIFuncs {
	wrap := func(f func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
		if f == nil {
			return nil
		}
		return func(a *skel.CmdArgs) error {
			if err := f(a); err != nil {
				return AsCNIError(err)
			}
			return nil
		}
	}
	return skel.CNIFuncs{Add: wrap(v.Add), Del: wrap(v.Del), Check: wrap(v.Check), Status: wrap(v.Status), GC: wrap(v.GC)}
}

// PluginMain runs one plugin invocation: skel dispatches CNI_COMMAND to v
// (errors mapped by Funcs), VERSION answers info, and about is the text
// skel prints when the binary is run by hand. It returns the process exit
// code: 0, or 1 after the error was printed to stdout as the spec asks.
// A failure to print the error goes to log (never stdout).
func PluginMain(v Verbs, info version.PluginInfo, about string, log *slog.Logger) int {
	err := skel.PluginMainFuncsWithError(Funcs(v), info, about)
	if err == nil {
		return 0
	}
	if perr := err.Print(); perr != nil {
		log.Error("failed to print error", "error", perr)
	}
	return 1
}
