package capture

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser"
)

// Installer installs and verifies rulesets in the network namespace given by
// a path, through netlink only (google/nftables and vishvananda/netlink on
// handles opened on the namespace fd; the calling thread never switches
// namespace). The zero value closes its netfilter sockets itself.
type Installer struct {
	// Closer, when set, takes over the netfilter socket of a commit that
	// removed anything (Install's edit or rewrite, Remove's table delete):
	// that socket's release waits for an RCU grace period
	// (meshcni/README.md), which then happens in the closer's exit instead
	// of this process's. It is started (in the background) only when such
	// a commit is coming; a fresh install, a stamped retry and an
	// insertion never start it. Where it cannot take the socket (no closer
	// image for this architecture, no name), the socket is closed here,
	// as without one, and Log says so at DEBUG. The process waits for the
	// closer (Wait) before it exits.
	Closer SocketCloser
	// Log receives a DEBUG line per hand-off: done, or fallen back to
	// closing here; nil logs nothing.
	Log *slog.Logger
}

// SocketCloser is a closer process that takes over sockets
// (sockcloser.ExecCloser): Start starts it in the background, Take hands it
// duplicates without waiting for its start, Wait waits for its start (and
// returns at once when it was never started), and returns why it could not start.
type SocketCloser interface {
	Start()
	Wait() error
	sockcloser.Taker
}

// CloserName is the name of aether-cni's socket closer process (in ps).
const CloserName = "aether-cni-socket-closer"

// inNS opens the namespace at path and runs fn with its fd.
func inNS(path string, fn func(fd int) error) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("failed to open netns %q: %w", path, err)
	}
	defer f.Close()
	return fn(int(f.Fd()))
}

// Install puts r in the namespace at nsPath: the inet table (replaced
// atomically in one nftables batch, so a retried ADD converges on the same
// state) and the fwmark rules and local routes for IPv4 and IPv6. IPv6
// policy routing is skipped when IPv6 is disabled in the namespace.
func (i Installer) Install(nsPath string, r Ruleset) error {
	return inNS(nsPath, func(fd int) error { return i.InstallFd(fd, r) })
}

// InstallFd is Install on an open namespace fd.
func (i Installer) InstallFd(fd int, r Ruleset) error {
	conn, handOff, err := i.installNFT(fd, r)
	if conn != nil {
		// A closer started for the commit starts while the routing is
		// installed; the socket goes to it after.
		defer i.release(conn, handOff)
	}
	if err != nil {
		return err
	}
	return installRouting(fd, r.Config)
}

// ErrNotInstalled is returned by Verify when the namespace holds no divert.
var ErrNotInstalled = errors.New("capture divert not installed")

// Verify compares the namespace's divert with r: the same chains (type,
// hook, priority), the same rules expression by expression, and the fwmark
// rules and local routes. It returns ErrNotInstalled when the table is
// missing and a descriptive error for any other difference.
func (Installer) Verify(nsPath string, r Ruleset) error {
	return inNS(nsPath, func(fd int) error { return VerifyFd(fd, r) })
}

// VerifyFd is Verify on an open namespace fd.
func VerifyFd(fd int, r Ruleset) error {
	c, err := openNFT(fd)
	if err != nil {
		return err
	}
	defer func() { _ = c.CloseLasting() }()
	t, err := c.ListTableOfFamily(TableName, nftables.TableFamilyINet)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("table inet %s: %w", TableName, ErrNotInstalled)
		}
		return fmt.Errorf("failed to list table %q: %w", TableName, err)
	}
	have, err := tableChains(c.Conn)
	if err != nil {
		return err
	}
	if err := verifyChains(c.Conn, t, have, r); err != nil {
		return err
	}
	return verifyRouting(fd, r.Config)
}

// Remove takes the divert of c out of the namespace at nsPath: the capture
// table, and the fwmark rules and local routes of c's table. What is
// already gone is no error, so Remove also cleans up after an Install that
// failed half-way (routing in place, table not).
func (i Installer) Remove(nsPath string, c Config) error {
	return inNS(nsPath, func(fd int) error { return i.RemoveFd(fd, c) })
}

// RemoveFd is Remove on an open namespace fd. The routing goes first and
// each part is tried even when another fails (a table that another netlink
// socket owns cannot be deleted, but the rules and routes still go).
func (i Installer) RemoveFd(fd int, c Config) error {
	c = c.Normalize()
	return errors.Join(removeRouting(fd, c), i.removeTable(fd))
}
