package preflight

import (
	"errors"
	"fmt"
	"os"

	"github.com/mdlayher/packet"

	"aether.io/node/pkg/sockcloser"
)

// CloserName is the name of eni-vlan's socket closer process (in ps).
const CloserName = "eni-vlan-socket-closer"

// NewExecCloser returns eni-vlan's socket closer (not started yet): a
// sockcloser.ExecCloser named CloserName.
func NewExecCloser() *sockcloser.ExecCloser { return &sockcloser.ExecCloser{Name: CloserName} }

// handOff gives duplicates of c's open sockets to cl and closes c's own
// copies (no grace period: cl's process still holds them).
func (c *Conn) handOff(cl sockcloser.Taker) error {
	var files []*os.File
	defer func() {
		for _, f := range files {
			_ = f.Close()
		}
	}()
	for _, pc := range []*packet.Conn{c.arp, c.ip6} {
		if pc == nil {
			continue
		}
		f, err := dupFile(pc)
		if err != nil {
			return err
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		return nil
	}
	if err := cl.Take(files); err != nil {
		return err
	}
	return c.closeLocal()
}

// dupFile returns a close-on-exec duplicate of pc's descriptor.
func dupFile(pc *packet.Conn) (*os.File, error) {
	rc, err := pc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("failed to get packet socket descriptor: %w", err)
	}
	return sockcloser.Dup(rc, "packet")
}

// closeLocal closes c's sockets in this process.
func (c *Conn) closeLocal() error {
	var errs []error
	if c.arp != nil {
		errs = append(errs, c.arp.Close())
		c.arp = nil
	}
	if c.ip6 != nil {
		errs = append(errs, c.ip6.Close())
		c.ip6 = nil
	}
	return errors.Join(errs...)
}
