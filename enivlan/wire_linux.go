package enivlan

import (
	"log/slog"
	"net"
	"os"

	"aether.io/node/enivlan/link"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/enivlan/spiderpool"
	"aether.io/node/pkg/sockcloser"
)

// New returns the plugin wired to the real spiderpool-agent, kernel
// (link.Default: 802.1Q, or the surrogate in a test build) and packet
// sockets, logging to log. The pre-flight's sockets are closed by a
// detached closer process (preflight.NewExecCloser, a sockcloser.ExecCloser
// started before IPAM ADD), so the runtime does not wait for their RCU grace
// period; on an architecture without a closer image (sockcloser.Supported)
// they are closed in this process. It does no I/O.
func New(log *slog.Logger) *Plugin {
	p := &Plugin{
		Linker:         link.Default(),
		DialSpiderpool: DialSpiderpool,
		OpenPreflight:  OpenPreflight,
		Log:            log,
		Stdout:         os.Stdout,
	}
	if sockcloser.Supported() {
		closer := preflight.NewExecCloser()
		p.OpenPreflight = func(l *net.Interface) Prober { return preflight.OpenWithCloser(l, closer) }
		p.PrepareCloser = closer.Start
		p.WaitCloser = closer.Wait
	}
	return p
}

// DialSpiderpool returns a spiderpool-agent client of socket.
func DialSpiderpool(socket string) Endpoints { return spiderpool.New(socket) }

// OpenPreflight opens the ARP/NDP pre-flight on l (sockets open lazily, in
// the netns of the first call that needs them), closing its sockets in
// this process.
func OpenPreflight(l *net.Interface) Prober { return preflight.Open(l) }
