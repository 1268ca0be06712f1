package enivlan

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/enivlan/config"
	"aether.io/node/enivlan/link"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/enivlan/spiderpool"
	"aether.io/node/pkg/cniutil"
	"aether.io/node/pkg/undo"
)

// Add implements CNI ADD as named steps (see README.md, "ADD"):
//
//	parse → allocate → bind → claim → configure → announce → result
//
// Each step that creates something pushes its undo; on any failure the
// undo stack runs once, in reverse (fail closed: record dropped, link
// deleted, IPAM released) and the step's error is returned.
func (p *Plugin) Add(a *skel.CmdArgs) error {
	c, err := p.parseAdd(a)
	if err != nil {
		return err
	}
	defer c.close()
	if err := c.run(); err != nil {
		return c.undo.Unwind(err, c.log)
	}
	return nil
}

// addCall is one ADD in progress: its inputs and what its steps made.
type addCall struct {
	p      *Plugin
	args   *skel.CmdArgs
	k      cniutil.K8sArgs
	conf   *config.NetConf
	log    *slog.Logger
	ctx    context.Context
	podNS  ns.NetNS
	master master
	mtu    int

	res           *current.Result
	closerStarted bool          // PrepareCloser was called
	recReady      chan struct{} // closed once prepare made the record's file
	recFile       *os.File      // the record's file from prepare, until committed
	recErr        error
	prepared      chan struct{} // closed once prepare is over
	fam           families
	endpoints     Endpoints
	binding       *spiderpool.Binding
	linkName      string         // the pod link's current name (temporary, then CNI_IFNAME)
	linkIndex     int            // the pod link's index in the pod netns, once configure found it
	ifi           *net.Interface // the pod link, once configure found it
	prober        Prober         // open between configure and the end of announce
	validation    map[string]string

	undo undo.Stack
	t    addTimings
}

// addTimings are the durations ADD logs (keys *_ms in "ADD done").
type addTimings struct {
	start                                                   time.Time
	ipam, endpoint, link, configure, preflight, socketClose time.Duration
}

// time runs f and adds its duration to d.
func (t *addTimings) time(d *time.Duration, f func() error) error {
	s := time.Now()
	err := f()
	*d += time.Since(s)
	return err
}

// attrs are the log attributes of t.
func (t *addTimings) attrs() []any {
	return []any{
		"ipam_ms", ms(t.ipam), "endpoint_ms", ms(t.endpoint), "link_ms", ms(t.link), "configure_ms", ms(t.configure),
		"preflight_ms", ms(t.preflight), "socket_close_ms", ms(t.socketClose), "total_ms", ms(time.Since(t.start)),
	}
}

// deleteLink deletes the pod link (in the pod netns): by index once
// configure found it (a failed rename may or may not have renamed it), else
// by its temporary name.
func (c *addCall) deleteLink() error {
	if c.linkIndex != 0 {
		return deleteLinkIndex(c.linkIndex)
	}
	return deleteLink(c.linkName)
}

// parseAdd is the parse step: netconf (code 7), CNI_ARGS (code 4), the pod
// netns, the master and the MTU. It creates nothing but the open netns.
func (p *Plugin) parseAdd(a *skel.CmdArgs) (*addCall, error) {
	conf, err := config.Parse(a.StdinData)
	if err != nil {
		return nil, err
	}
	k, err := cniutil.ParseK8sArgs(a.Args)
	if err != nil {
		return nil, &types.Error{Code: types.ErrInvalidEnvironmentVariables, Msg: err.Error()}
	}
	if k.PodName == "" || k.PodNamespace == "" {
		return nil, &types.Error{Code: types.ErrInvalidEnvironmentVariables, Msg: "CNI_ARGS must carry K8S_POD_NAME and K8S_POD_NAMESPACE: eni-vlan looks the pod's cloud binding up by them"}
	}
	podNS, err := ns.GetNS(a.Netns)
	if err != nil {
		return nil, fmt.Errorf("failed to open netns %q: %w", a.Netns, err)
	}
	m, err := findMaster(conf, podNS)
	if err != nil {
		_ = podNS.Close()
		return nil, err
	}
	mtu := conf.MTU
	if mtu == 0 {
		mtu = m.mtu
	}
	if mtu > m.mtu {
		_ = podNS.Close()
		return nil, cniutil.InvalidConfigf("invalid \"mtu\" %d: want at most the MTU of master %q (%d)", conf.MTU, conf.Master, m.mtu)
	}
	return &addCall{
		p: p, args: a, k: k, conf: conf, log: p.logFor(a, k), ctx: context.Background(),
		podNS: podNS, master: m, mtu: mtu, validation: map[string]string{},
	}, nil
}

// close releases what the call holds open whatever the outcome, and waits
// for the closer's start if this call started it (Plugin.WaitCloser).
func (c *addCall) close() {
	if c.endpoints != nil {
		c.endpoints.Close()
	}
	_ = c.podNS.Close()
	if c.prepared != nil {
		<-c.prepared
		if c.recFile != nil {
			discardRecordFile(c.recFile)
		}
	}
	if c.closerStarted && c.p.WaitCloser != nil {
		if err := c.p.WaitCloser(); err != nil {
			c.log.Debug("socket closer did not start; the pre-flight's sockets are released at exit", "error", err.Error())
		}
	}
}

// run runs the steps after parse; the caller unwinds on error.
func (c *addCall) run() error {
	c.t.start = time.Now()
	// What ADD can make before the IPAM delegate answers is made while it
	// waits for it, on the core the delegate leaves idle: the record's
	// file and the codecs (prepare), and the closer process (validation
	// on), needed after the pre-flight. Started after the delegate, the
	// closer's fork and exec competed with spiderpool-agent's answer for
	// the two cores (README.md, "Performance notes").
	c.prepare()
	if c.conf.ValidateIaasNetConfig && c.p.PrepareCloser != nil {
		c.p.PrepareCloser()
		c.closerStarted = true
	}
	if err := c.t.time(&c.t.ipam, c.allocate); err != nil {
		return err
	}
	if err := c.t.time(&c.t.endpoint, c.bind); err != nil {
		return err
	}
	if err := c.t.time(&c.t.link, c.claim); err != nil {
		return err
	}
	err := c.t.time(&c.t.configure, func() error {
		err := c.configure()
		c.closeProber()
		return err
	})
	if err != nil {
		return err
	}
	if len(c.conf.DNS.Nameservers) > 0 || c.conf.DNS.Domain != "" {
		c.res.DNS = c.conf.DNS
	}
	c.log.Info("ADD done", append([]any{keyLink, c.p.Linker.Kind(), "validation", c.validation}, c.t.attrs()...)...)
	return c.p.printResult(c.res, c.conf.CNIVersion, c.validation)
}

// allocate is IPAM ADD; its undo is IPAM DEL.
func (c *addCall) allocate() error {
	ipamRes, err := c.p.ipam(c.ctx, "ADD", c.conf, c.args.StdinData)
	if err != nil {
		return fmt.Errorf("failed to allocate addresses with IPAM %q: %w", c.conf.IPAMConf.Type, err)
	}
	c.undo.Push(undo.Entry{
		What:   func() string { return "releasing IPAM" },
		LogErr: func(log *slog.Logger, err error) { log.Error("failed to release IPAM after failed ADD", keyErr, err) },
		Fn:     func() error { return c.p.releaseIPAM(c.ctx, c.conf, c.args.StdinData) },
	})
	res, err := current.NewResultFromResult(ipamRes)
	if err != nil {
		return fmt.Errorf("failed to convert IPAM result: %w", err)
	}
	if len(res.IPs) == 0 {
		return fmt.Errorf("failed to allocate addresses with IPAM %q: the result has no IPs", c.conf.IPAMConf.Type)
	}
	c.res, c.fam = res, familiesOf(res.IPs)
	return nil
}

// bind asks spiderpool-agent for the pod's VLAN ID and sub-ENI MAC within
// the endpoint budget; a budget spent on answers that may still change is
// code 11.
func (c *addCall) bind() error {
	k, ifName := c.k, c.args.IfName
	c.endpoints = c.p.DialSpiderpool(c.conf.SpiderpoolSocket)
	q := c.fam.query(spiderpool.Query{PodNamespace: k.PodNamespace, PodName: k.PodName, PodUID: k.PodUID, IfName: ifName})
	ctx, cancel := context.WithTimeout(c.ctx, c.conf.EndpointTimeout())
	defer cancel()
	b, err := c.endpoints.Lookup(ctx, q)
	if err != nil {
		var le *spiderpool.LookupError
		if errors.As(err, &le) && le.Retryable {
			return cniutil.TryAgainf("failed to get the cloud binding of pod %s/%s interface %q from spiderpool-agent within %s: %w", k.PodNamespace, k.PodName, ifName, c.conf.EndpointTimeout(), err)
		}
		return fmt.Errorf("failed to get the cloud binding of pod %s/%s interface %q from spiderpool-agent: %w", k.PodNamespace, k.PodName, ifName, err)
	}
	c.binding = b
	c.log = c.log.With(keyVLAN, b.VLAN, keyMAC, b.MAC.String())
	return nil
}

// claim makes (master, VLAN ID) this pod's under the state lock: resolve a
// previous holder, write the ownership record into the file prepare
// made (before the link when the pair had no record, after it when the
// record was this attachment's own) and create the link under a temporary
// name in the pod netns. Its undos delete the link and drop the record. On
// failure those two undos run before the lock is released (so no other ADD
// finds a device without its record) and IPAM's after it.
func (c *addCall) claim() (err error) {
	unlock, err := lockState(c.conf.StateDir)
	if err != nil {
		return err
	}
	mark := c.undo.Mark()
	defer func() {
		if err != nil {
			err = c.undo.UnwindTo(mark, err, c.log)
		}
		unlock()
	}()
	k, vlan := c.k, c.binding.VLAN
	cid := k.ContainerID(c.args.ContainerID)
	own, err := c.p.resolveHolder(c.ctx, c.conf, c.endpoints, c.log, cid, c.args.IfName, k, vlan)
	if err != nil {
		return err
	}
	rec := &record{
		Master: c.conf.Master, VLAN: vlan, MAC: c.binding.MAC.String(), ContainerID: cid, NetNS: c.args.Netns, IfName: c.args.IfName,
		PodNamespace: k.PodNamespace, PodName: k.PodName, PodUID: k.PodUID,
	}
	f, err := c.recordFile()
	if err != nil {
		return err
	}
	// With no record for the pair (the usual case) the record is written
	// before the link is created: both are undone under the lock if either
	// fails, so no other ADD sees the difference. Our own record from an
	// earlier attempt is only replaced once the link exists: a failed link
	// must not drop it.
	if !own {
		if err := c.commitRecord(f, rec); err != nil {
			return err
		}
	}
	c.linkName = fmt.Sprintf("ev%x", time.Now().UnixNano()&0xffffffffff)
	spec := link.Spec{
		MasterIndex: c.master.index, MasterInPod: c.conf.LinkInContainer, VLAN: vlan, MAC: c.binding.MAC, MTU: c.mtu,
		TempName: c.linkName, IfName: c.args.IfName, PodNS: c.podNS,
	}
	if c.conf.LinkInContainer {
		// The master is in the pod netns: create the link there.
		err = c.podNS.Do(func(ns.NetNS) error { return c.p.Linker.Add(spec) })
	} else {
		err = c.p.Linker.Add(spec)
	}
	if errors.Is(err, link.ErrVLANExists) {
		return fmt.Errorf("failed to create the link for pod %s/%s: VLAN %d on master %q is already held by a device eni-vlan has no record of (created outside eni-vlan?): %w", k.PodNamespace, k.PodName, vlan, c.conf.Master, err)
	}
	if err != nil {
		return err
	}
	c.undo.Push(undo.Entry{
		What:   func() string { return fmt.Sprintf("deleting link %q", c.linkName) },
		LogErr: func(log *slog.Logger, err error) { log.Error("failed to delete link after failed ADD", keyErr, err) },
		Fn:     func() error { return c.podNS.Do(func(ns.NetNS) error { return c.deleteLink() }) },
	})
	if own {
		return c.commitRecord(f, rec)
	}
	return nil
}

// prepare does, on another goroutine while ADD waits for the IPAM
// delegate (a core is otherwise idle then), what ADD needs later and can
// make without the delegate's answer or the binding: the ownership
// record's file (createRecordFile: a new inode is the costly part of
// writing the record, and neither the pair nor the state lock is needed
// for it), then encoding/json's codecs of what ADD decodes and encodes
// after the delegate (prepareCodecs). claim waits for the file only; close
// joins the goroutine and removes the file if no record was made of it.
func (c *addCall) prepare() {
	c.recReady, c.prepared = make(chan struct{}), make(chan struct{})
	log, dir, cid, ifName, ver := c.log, c.conf.StateDir, c.args.ContainerID, c.args.IfName, c.conf.CNIVersion
	go func() {
		defer close(c.prepared)
		c.recFile, c.recErr = createRecordFile(dir, cid, ifName)
		close(c.recReady)
		if err := prepareCodecs(ver); err != nil {
			log.Debug("failed to prepare the codecs; they are built on first use", keyErr, err)
		}
	}()
}

// recordFile waits for prepare's record file.
func (c *addCall) recordFile() (*os.File, error) {
	<-c.recReady
	return c.recFile, c.recErr
}

// commitRecord makes f the pair's ownership record (commitRecord; the
// state lock is held) and pushes dropping it onto the undo stack.
func (c *addCall) commitRecord(f *os.File, rec *record) error {
	if err := commitRecord(f, c.conf.StateDir, rec); err != nil {
		return err
	}
	c.recFile = nil
	c.undo.Push(undo.Entry{Fn: func() error { removeRecord(c.conf.StateDir, rec.Master, rec.VLAN); return nil }})
	return nil
}

// configure runs in the pod netns, entered once: rename the link to
// CNI_IFNAME (with the Linker's alias, and up when validating, in the same
// request), then either (validation on) run the pre-flight with no IP, add
// addresses and routes and announce them, or (validation off) add the
// addresses, let the kernel announce them on up, and add routes. Its
// netlink requests share one socket.
func (c *addCall) configure() error {
	ifName := c.args.IfName
	return c.podNS.Do(func(ns.NetNS) error {
		h, err := netlinksafe.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("failed to open a netlink socket in netns %q: %w", c.args.Netns, err)
		}
		defer h.Close()
		// Index and MTU by ioctl (a netlink lookup would have the kernel
		// dump every attribute of the link); the MAC is the one the link
		// was created with (the kernel sets IFLA_ADDRESS or fails the
		// create).
		index, mtu, err := linkIndexMTU(c.linkName)
		if err != nil {
			return fmt.Errorf("failed to find link %q: %w", c.linkName, err)
		}
		c.linkIndex = index
		l := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: index, Name: c.linkName, MTU: mtu, HardwareAddr: c.binding.MAC}}
		validate := c.conf.ValidateIaasNetConfig
		// Validation on: the pre-flight runs on a link that is up with its
		// real MAC and no address. Off: addresses go on before the link
		// comes up, and the kernel announces them on up (arp_notify,
		// ndisc_notify), with no packet socket to pay for.
		if err := setLink(c.linkIndex, ifName, c.p.Linker.Alias(c.binding.VLAN), validate); err != nil {
			return fmt.Errorf("failed to rename link %q to %q: %w", c.linkName, ifName, err)
		}
		c.linkName = ifName
		l.Name = ifName
		ifi := &net.Interface{Index: c.linkIndex, Name: ifName, HardwareAddr: l.HardwareAddr, MTU: l.MTU}
		c.ifi = ifi
		c.res.Interfaces = []*current.Interface{{Name: ifName, Mac: ifi.HardwareAddr.String(), Mtu: ifi.MTU, Sandbox: c.args.Netns}}
		for _, ipc := range c.res.IPs {
			ipc.Interface = current.Int(0)
		}
		if !validate {
			c.validation["ipv4"], c.validation["ipv6"] = "disabled", "disabled"
			setNotify(ifName)
			if err := addAddrs(h, l, c.res); err != nil {
				return err
			}
			if err := h.LinkSetUp(l); err != nil {
				return fmt.Errorf("failed to set link %q up: %w", ifName, err)
			}
			return addRoutes(h, l, c.res, c.fam)
		}
		c.prober = c.p.OpenPreflight(ifi)
		if err := c.t.time(&c.t.preflight, func() error { return c.preflight(ifi) }); err != nil {
			return err
		}
		if err := addAddrs(h, l, c.res); err != nil {
			return err
		}
		if err := addRoutes(h, l, c.res, c.fam); err != nil {
			return err
		}
		c.announce()
		return nil
	})
}

// announce sends a gratuitous ARP / unsolicited NA per address on the
// pre-flight's sockets (validation on; off, the kernel announced). It runs
// in the pod netns, at the end of configure. A failed announcement is
// logged, not fatal.
func (c *addCall) announce() {
	for _, ipc := range c.res.IPs {
		a, _ := netip.AddrFromSlice(ipc.Address.IP)
		if err := c.prober.Announce(c.ifi.HardwareAddr, a.Unmap()); err != nil {
			c.log.Warn("failed to announce address", keyIP, a, keyErr, err)
		}
	}
}

// closeProber closes the pre-flight's sockets (timed: closing a packet
// socket waits for an RCU grace period).
func (c *addCall) closeProber() {
	if c.prober == nil {
		return
	}
	_ = c.t.time(&c.t.socketClose, func() error {
		if err := c.prober.Close(); err != nil {
			c.log.Warn("failed to close probe sockets", keyErr, err)
		}
		return nil
	})
	c.prober = nil
}

// preflight probes each family that has a gateway; it runs in the pod
// netns. No reply fails closed with code 11 (a binding not pushed yet
// becomes effective later, and the runtime retries the sandbox).
func (c *addCall) preflight(ifi *net.Interface) error {
	vlan := c.binding.VLAN
	for _, fam := range c.fam.each() {
		if fam.addr == nil {
			c.validation[fam.name] = "skipped: no " + fam.name + " address"
			continue
		}
		if fam.gw == nil {
			c.validation[fam.name] = "skipped: IPAM result has no " + fam.name + " gateway"
			c.log.Info("pre-flight skipped: no gateway", keyFamily, fam.name)
			continue
		}
		src, _ := netip.AddrFromSlice(fam.addr.Address.IP)
		gw, _ := netip.AddrFromSlice(fam.gw)
		src, gw = src.Unmap(), gw.Unmap()
		spec := preflight.Spec{Link: ifi, MAC: ifi.HardwareAddr, IP: src, Gateway: gw, Attempts: c.conf.ValidationRetries, Timeout: c.conf.ValidationTimeout()}
		r, err := c.prober.Probe(c.ctx, spec)
		var nr *preflight.NoReplyError
		if errors.As(err, &nr) {
			c.log.Info("pre-flight failed: failing closed", keyFamily, fam.name, keyIP, src, keyGateway, gw, keyAttempts, spec.Attempts)
			return cniutil.TryAgainf("%w", &FailClosedError{IP: src, Gateway: gw, VLAN: vlan, MAC: ifi.HardwareAddr, Attempts: spec.Attempts, Timeout: spec.Timeout})
		}
		if err != nil {
			return fmt.Errorf("failed to validate the cloud binding (IP %s, VLAN %d, MAC %s, gateway %s): %w", src, vlan, ifi.HardwareAddr, gw, err)
		}
		c.validation[fam.name] = fmt.Sprintf("ok: gateway %s answered attempt %d in %s", gw, r.Attempts, r.RTT.Round(time.Microsecond))
		c.log.Info("pre-flight ok", keyFamily, fam.name, keyGateway, gw, keyAttempts, r.Attempts, keyRTT, r.RTT)
	}
	return nil
}
