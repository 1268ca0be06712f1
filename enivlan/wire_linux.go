package enivlan

import (
	"log/slog"
	"net"
	"os"

	"aether.io/node/enivlan/link"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/enivlan/spiderpool"
)

// New returns the plugin wired to the real spiderpool-agent, kernel
// (link.Default: 802.1Q, or the surrogate in a test build) and packet
// sockets, logging to log. It does no I/O.
func New(log *slog.Logger) *Plugin {
	return &Plugin{
		Linker:         link.Default(),
		DialSpiderpool: DialSpiderpool,
		OpenPreflight:  OpenPreflight,
		Log:            log,
		Stdout:         os.Stdout,
	}
}

// DialSpiderpool returns a spiderpool-agent client of socket.
func DialSpiderpool(socket string) Endpoints { return spiderpool.New(socket) }

// OpenPreflight opens the ARP/NDP pre-flight on l (sockets open lazily, in
// the netns of the first call that needs them).
func OpenPreflight(l *net.Interface) Prober { return preflight.Open(l) }
