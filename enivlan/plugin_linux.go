package enivlan

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"aether.io/node/enivlan/config"
	"aether.io/node/enivlan/link"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/enivlan/spiderpool"
	"aether.io/node/pkg/cniutil"
)

// ValidationKey is the key eni-vlan adds to its ADD result to say what the
// pre-flight did per family ("ok ...", "skipped: ...", "disabled").
const ValidationKey = "eni-vlan.aether.io/validation"

// Endpoints is spiderpool-agent as eni-vlan asks it (*spiderpool.Client;
// a fake in unit tests).
type Endpoints interface {
	// Lookup returns the pod's validated cloud binding, retrying within
	// ctx while the answer may still change.
	Lookup(ctx context.Context, q spiderpool.Query) (*spiderpool.Binding, error)
	// Get is one GET /v1/workloadendpoint.
	Get(ctx context.Context, podNamespace, podName string) (*spiderpool.WorkloadEndpointStatus, error)
	// Healthy is GET /v1/ipam/healthy.
	Healthy(ctx context.Context) error
	// Close releases idle connections.
	Close()
}

// Prober is the ARP/NDP pre-flight on one link, used from inside the pod
// netns (*preflight.Conn; a fake in unit tests).
type Prober interface {
	// Probe asks s.Gateway for s.IP's binding; no matching reply within
	// the budget is a *preflight.NoReplyError.
	Probe(ctx context.Context, s preflight.Spec) (preflight.Result, error)
	// Announce sends a gratuitous ARP or unsolicited NA for ip from mac.
	Announce(mac net.HardwareAddr, ip netip.Addr) error
	// Close closes the sockets.
	Close() error
}

// Plugin implements eni-vlan's CNI verbs. Its fields are its dependencies;
// New wires the real ones, unit tests fakes. Constructing it does no I/O.
type Plugin struct {
	// Linker creates and verifies the pod link.
	Linker link.Linker
	// DialSpiderpool returns a client of the spiderpool-agent listening on
	// socket (no I/O until it is used).
	DialSpiderpool func(socket string) Endpoints
	// OpenPreflight opens the pre-flight on link; it is called inside the
	// pod netns, and its sockets are opened there on first use.
	OpenPreflight func(link *net.Interface) Prober
	// PrepareCloser, when set, is called once by an ADD with validation
	// on, before IPAM ADD, so that whatever the Prober's Close needs (the
	// closer process, sockcloser.ExecCloser.Start) starts while ADD waits
	// for the IPAM delegate.
	PrepareCloser func()
	// WaitCloser, when set, is called before an ADD that called
	// PrepareCloser returns: the sockets handed to the closer wait in its
	// socket pair until its fork, and an exit before that would release
	// them in this process (the grace period on the runtime's wait again).
	// Its error (the closer could not start) is logged at DEBUG.
	WaitCloser func() error
	// Log receives the plugin's logs (never stdout).
	Log *slog.Logger
	// Stdout receives the ADD result.
	Stdout io.Writer
	// Exec runs the IPAM delegate (nil: the real exec).
	Exec invoke.Exec
}

// Verbs returns p's CNI verbs for cniutil.PluginMain.
func (p *Plugin) Verbs() cniutil.Verbs {
	return cniutil.Verbs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

// SupportedVersions are the CNI spec versions eni-vlan speaks.
var SupportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

func (p *Plugin) ipam(ctx context.Context, verb string, conf *config.NetConf, stdin []byte) (types.Result, error) {
	in, err := IPAMStdin(stdin)
	if err != nil {
		return nil, err
	}
	t := conf.IPAMConf.Type
	switch verb {
	case "ADD":
		return invoke.DelegateAdd(ctx, t, in, p.Exec)
	case "DEL":
		return nil, invoke.DelegateDel(ctx, t, in, p.Exec)
	case "CHECK":
		return nil, invoke.DelegateCheck(ctx, t, in, p.Exec)
	}
	return nil, fmt.Errorf("unknown IPAM verb %q", verb)
}

// newLoggerFor returns p.Log extended with the call's identity.
func (p *Plugin) logFor(a *skel.CmdArgs, k cniutil.K8sArgs) *slog.Logger {
	return p.Log.With(keyContainer, k.ContainerID(a.ContainerID), keyPod, k.PodNamespace+"/"+k.PodName, keyIfName, a.IfName)
}

// master is the master link as seen in its namespace.
type master struct {
	index int
	mtu   int
	name  string
}

func findMaster(conf *config.NetConf, podNS ns.NetNS) (master, error) {
	var m master
	look := func() error {
		index, mtu, err := linkIndexMTU(conf.Master)
		if err != nil {
			where := "the host"
			if conf.LinkInContainer {
				where = "the pod"
			}
			return cniutil.InvalidConfigf("invalid \"master\" %q: no such interface in %s network namespace (linkInContainer=%v): %v", conf.Master, where, conf.LinkInContainer, err)
		}
		m = master{index: index, mtu: mtu, name: conf.Master}
		return nil
	}
	if conf.LinkInContainer {
		return m, podNS.Do(func(ns.NetNS) error { return look() })
	}
	return m, look()
}

// linkIndexMTU returns the index and MTU of the link name in the current
// netns: two ioctls on one socket, where a netlink lookup has the kernel
// dump, and the plugin parse, every attribute of the link (statistics
// included) for these two numbers.
func linkIndexMTU(name string) (index, mtu int, err error) {
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return 0, 0, err
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("failed to open a socket for interface ioctls: %w", err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFINDEX, ifr); err != nil {
		return 0, 0, fmt.Errorf("failed to get the index of %q: %w", name, err)
	}
	index = int(ifr.Uint32())
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFMTU, ifr); err != nil {
		return 0, 0, fmt.Errorf("failed to get the MTU of %q: %w", name, err)
	}
	return index, int(ifr.Uint32()), nil
}

// printResult prints res as version ver with ValidationKey added
// (encodeResult).
func (p *Plugin) printResult(res *current.Result, ver string, validation map[string]string) error {
	out, err := encodeResult(res, ver, validation)
	if err != nil {
		return err
	}
	w := p.Stdout
	if w == nil {
		w = os.Stdout
	}
	_, err = w.Write(out)
	return err
}

// FailClosedError is the ADD error when the pre-flight got no reply.
type FailClosedError struct {
	// IP is the allocated address the probe was sent from.
	IP netip.Addr
	// Gateway is the address that did not answer.
	Gateway netip.Addr
	// VLAN is the VLAN ID the link carried.
	VLAN int
	// MAC is the link's (sub-ENI) MAC.
	MAC net.HardwareAddr
	// Attempts and Timeout are the probe budget that was spent.
	Attempts int
	// Timeout is the reply timeout of one attempt.
	Timeout time.Duration
}

func (e *FailClosedError) Error() string {
	return fmt.Sprintf("cloud binding not effective: no reply from gateway %s to IP %s on VLAN %d with MAC %s after %d attempt(s) of %s; wrong VLAN, MAC not bound yet or IP-MAC binding not pushed; IPAM released and link deleted",
		e.Gateway, e.IP, e.VLAN, e.MAC, e.Attempts, e.Timeout)
}

// setNotify asks the kernel to announce the link's addresses when it comes
// up (gratuitous ARP, unsolicited NA). IPv6 may be disabled: best effort.
func setNotify(ifName string) {
	_ = os.WriteFile("/proc/sys/net/ipv4/conf/"+ifName+"/arp_notify", []byte("1"), 0o644)
	_ = os.WriteFile("/proc/sys/net/ipv6/conf/"+ifName+"/ndisc_notify", []byte("1"), 0o644)
}

// addAddrs adds the result's addresses to l (through h, in l's netns).
// IPv6 addresses skip DAD: the fabric's IP-MAC binding already rules
// conflicts out (and the pre-flight, when on, proved it live).
func addAddrs(h netlinksafe.Handle, l netlink.Link, res *current.Result) error {
	for _, c := range res.IPs {
		a := &netlink.Addr{IPNet: &net.IPNet{IP: c.Address.IP, Mask: c.Address.Mask}}
		if c.Address.IP.To4() == nil {
			a.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(l, a); err != nil {
			return fmt.Errorf("failed to add address %s to %q: %w", c.Address.String(), l.Attrs().Name, err)
		}
	}
	return nil
}

// addRoutes adds the result's routes via l (up; through h, in l's netns);
// a route without a gateway uses its family's gateway (fam).
func addRoutes(h netlinksafe.Handle, l netlink.Link, res *current.Result, fam families) error {
	for _, r := range res.Routes {
		gw := r.GW
		if gw == nil {
			gw = fam.gateway(r.Dst.IP)
		}
		rt := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: &r.Dst, Gw: gw, MTU: r.MTU, AdvMSS: r.AdvMSS, Priority: r.Priority}
		if r.Table != nil {
			rt.Table = *r.Table
		}
		if r.Scope != nil {
			rt.Scope = netlink.Scope(*r.Scope)
		}
		if err := h.RouteAddEcmp(rt); err != nil {
			return fmt.Errorf("failed to add route %s via %s on %q: %w", r.Dst.String(), gw, l.Attrs().Name, err)
		}
	}
	return nil
}

func deleteLink(name string) error {
	l, err := netlinksafe.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("failed to find link %q: %w", name, err)
	}
	if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("failed to delete link %q: %w", name, err)
	}
	return nil
}

// deleteLinkIndex deletes the link index of the current netns; a link that
// is gone is success.
func deleteLinkIndex(index int) error {
	err := netlink.LinkDel(&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: index}})
	if err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("failed to delete link %d: %w", index, err)
	}
	return nil
}

func (p *Plugin) releaseIPAM(ctx context.Context, conf *config.NetConf, stdin []byte) error {
	_, err := p.ipam(ctx, "DEL", conf, stdin)
	if err != nil {
		return fmt.Errorf("failed to release addresses with IPAM %q: %w", conf.IPAMConf.Type, err)
	}
	return nil
}

// resolveHolder makes sure no other live pod holds (master, vlan): a record
// whose device is gone is dropped; a device whose owner is gone (same pod
// with a new sandbox, or the agent no longer binds this VLAN/MAC to it) is
// deleted; a device still in use is an error. own reports that the pair's
// record is this attachment's own, from an earlier attempt (it is kept).
// Called under the state lock.
func (p *Plugin) resolveHolder(ctx context.Context, conf *config.NetConf, client Endpoints, log *slog.Logger, cid, ifName string, k cniutil.K8sArgs, vlan int) (own bool, err error) {
	r, err := readRecord(conf.StateDir, conf.Master, vlan)
	if err != nil || r == nil {
		return false, err
	}
	if r.ContainerID == cid && r.IfName == ifName {
		// Our own record from an earlier attempt; the runtime DELs between
		// ADDs, and if it did not the kernel refuses a duplicate anyway.
		return true, nil
	}
	alive, err := p.holderDevice(r, vlan, false)
	if err != nil {
		return false, err
	}
	if !alive {
		removeRecord(conf.StateDir, conf.Master, vlan)
		return false, nil
	}
	gone, why := false, ""
	if r.PodNamespace == k.PodNamespace && r.PodName == k.PodName {
		gone, why = true, "same pod, new sandbox"
	} else {
		gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		s, err := client.Get(gctx, r.PodNamespace, r.PodName)
		cancel()
		var se *spiderpool.StatusError
		switch {
		case errors.As(err, &se) && se.Code == 404:
			gone, why = true, "spiderpool-agent has no endpoint for the holder"
		case err == nil:
			if hb, serr := spiderpool.Select(s, spiderpool.Query{IfName: r.IfName}); serr != nil || hb.VLAN != vlan || hb.MAC.String() != r.MAC {
				gone, why = true, "spiderpool-agent no longer binds this VLAN and MAC to the holder"
			}
		}
	}
	if !gone {
		return false, cniutil.TryAgainf("VLAN %d on master %q is in use by pod %s/%s (container %s, interface %q in %s): Linux allows one VLAN device per master and VLAN ID; wait for that pod's DEL",
			vlan, conf.Master, r.PodNamespace, r.PodName, r.ContainerID, r.IfName, r.NetNS)
	}
	if _, err := p.holderDevice(r, vlan, true); err != nil {
		return false, fmt.Errorf("failed to remove stale VLAN %d device of gone pod %s/%s: %w", vlan, r.PodNamespace, r.PodName, err)
	}
	removeRecord(conf.StateDir, conf.Master, vlan)
	log.Info("removed stale VLAN device of a gone pod", "holder", r.PodNamespace+"/"+r.PodName, "holder_container", r.ContainerID, "reason", why)
	return false, nil
}

// holderDevice reports whether r's device still exists (and deletes it when
// del is set).
func (p *Plugin) holderDevice(r *record, vlan int, del bool) (bool, error) {
	if r.NetNS == "" {
		return false, nil
	}
	hns, err := ns.GetNS(r.NetNS)
	if err != nil {
		return false, nil // the namespace is gone and its devices with it
	}
	defer func() { _ = hns.Close() }()
	alive := false
	err = hns.Do(func(ns.NetNS) error {
		l, err := netlinksafe.LinkByName(r.IfName)
		if err != nil {
			return nil
		}
		if p.Linker.Verify(l, vlan) != nil || l.Attrs().HardwareAddr.String() != r.MAC {
			return nil
		}
		alive = true
		if del {
			return deleteLink(r.IfName)
		}
		return nil
	})
	return alive, err
}

// Del implements CNI DEL: IPAM is released first, then the link is deleted.
// A missing or empty netns, a missing link or a gone master is success.
func (p *Plugin) Del(a *skel.CmdArgs) error {
	conf, err := config.ParseForDel(a.StdinData)
	if err != nil {
		return err
	}
	k, _ := cniutil.ParseK8sArgs(a.Args)
	if err := p.releaseIPAM(context.Background(), conf, a.StdinData); err != nil {
		return err
	}
	if a.Netns != "" {
		err := ns.WithNetNSPath(a.Netns, func(ns.NetNS) error { return deleteLink(a.IfName) })
		var notExist ns.NSPathNotExistErr
		var notNS ns.NSPathNotNSErr
		// A netns that is gone (or whose mount point is left as a plain
		// file) took the link with it.
		if err != nil && !errors.As(err, &notExist) && !errors.As(err, &notNS) && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("failed to delete link %q in %q: %w", a.IfName, a.Netns, err)
		}
	}
	if unlock, err := lockState(conf.StateDir); err == nil {
		removeRecordsOf(conf.StateDir, k.ContainerID(a.ContainerID), a.IfName)
		// An ADD that died before it committed its record file left it.
		_ = os.Remove(recordFilePath(conf.StateDir, a.ContainerID, a.IfName))
		unlock()
	}
	return nil
}

// Check implements CNI CHECK: IPAM CHECK, then the live link against
// prevResult and the agent's binding (kind, VLAN ID, MAC, MTU, IPs, routes).
func (p *Plugin) Check(a *skel.CmdArgs) error {
	conf, err := config.Parse(a.StdinData)
	if err != nil {
		return err
	}
	if conf.RawPrevResult == nil {
		return cniutil.InvalidConfigf("CHECK needs \"prevResult\": the runtime passes the ADD result")
	}
	if err := version.ParsePrevResult(&conf.NetConf); err != nil {
		return cniutil.InvalidConfigf("failed to parse \"prevResult\": %v", err)
	}
	prev, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return fmt.Errorf("failed to convert prevResult: %w", err)
	}
	k, err := cniutil.ParseK8sArgs(a.Args)
	if err != nil {
		return &types.Error{Code: types.ErrInvalidEnvironmentVariables, Msg: err.Error()}
	}
	ctx := context.Background()
	if _, err := p.ipam(ctx, "CHECK", conf, a.StdinData); err != nil {
		return fmt.Errorf("failed IPAM %q CHECK: %w", conf.IPAMConf.Type, err)
	}
	var want *current.Interface
	idx := -1
	for i, in := range prev.Interfaces {
		if in.Name == a.IfName && (in.Sandbox == "" || in.Sandbox == a.Netns) {
			want, idx = in, i
		}
	}
	if want == nil {
		return fmt.Errorf("failed to check: prevResult has no interface %q in %q", a.IfName, a.Netns)
	}
	var ips []*current.IPConfig
	for _, c := range prev.IPs {
		if c.Interface != nil && *c.Interface == idx {
			ips = append(ips, c)
		}
	}
	q := familiesOf(ips).query(spiderpool.Query{PodNamespace: k.PodNamespace, PodName: k.PodName, PodUID: k.PodUID, IfName: a.IfName})
	client := p.DialSpiderpool(conf.SpiderpoolSocket)
	defer client.Close()
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	s, err := client.Get(gctx, k.PodNamespace, k.PodName)
	cancel()
	if err != nil {
		return cniutil.TryAgainf("failed to check the cloud binding with spiderpool-agent: %w", err)
	}
	b, err := spiderpool.Select(s, q)
	if err != nil {
		return fmt.Errorf("failed to check the cloud binding: %w", err)
	}
	podNS, err := ns.GetNS(a.Netns)
	if err != nil {
		return fmt.Errorf("failed to open netns %q: %w", a.Netns, err)
	}
	defer func() { _ = podNS.Close() }()
	// Expected MTU: prevResult's (1.0.0+), else the netconf's, else the
	// master's (0.4.0 results carry no MTU).
	wantMTU, mtuFrom := want.Mtu, "prevResult"
	if wantMTU == 0 && conf.MTU != 0 {
		wantMTU, mtuFrom = conf.MTU, "the network configuration"
	}
	if wantMTU == 0 {
		if m, err := findMaster(conf, podNS); err == nil {
			wantMTU, mtuFrom = m.mtu, fmt.Sprintf("master %q", conf.Master)
		}
	}
	return podNS.Do(func(ns.NetNS) error {
		l, err := netlinksafe.LinkByName(a.IfName)
		if err != nil {
			return fmt.Errorf("failed to find link %q: %w", a.IfName, err)
		}
		if err := p.Linker.Verify(l, b.VLAN); err != nil {
			return fmt.Errorf("failed to check link %q: %w", a.IfName, err)
		}
		mac := l.Attrs().HardwareAddr.String()
		if !strings.EqualFold(mac, want.Mac) {
			return fmt.Errorf("link %q has MAC %s, prevResult says %s", a.IfName, mac, want.Mac)
		}
		if !strings.EqualFold(mac, b.MAC.String()) {
			return fmt.Errorf("link %q has MAC %s, spiderpool-agent binds %s", a.IfName, mac, b.MAC)
		}
		if wantMTU != 0 && l.Attrs().MTU != wantMTU {
			return fmt.Errorf("link %q has MTU %d, %s says %d", a.IfName, l.Attrs().MTU, mtuFrom, wantMTU)
		}
		if err := checkAddrs(l, ips); err != nil {
			return fmt.Errorf("failed to check addresses of %q: %w", a.IfName, err)
		}
		return checkRoutes(l, prev)
	})
}

// setLink renames the link index (in the current netns) to name, sets its
// alias when alias is not empty and, with up, sets it up: one RTM_SETLINK
// (the kernel applies the name, then the alias, then the flags), where
// plugins' ip.RenameLink and netlink.LinkSetUp take a lookup and two
// requests. The reference vlan plugin also creates its link under a
// temporary name and renames it in the pod netns.
func setLink(index int, name, alias string, up bool) error {
	req := nl.NewNetlinkRequest(unix.RTM_SETLINK, unix.NLM_F_ACK)
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(index)
	if up {
		msg.Flags, msg.Change = unix.IFF_UP, unix.IFF_UP
	}
	req.AddData(msg)
	req.AddData(nl.NewRtAttr(unix.IFLA_IFNAME, nl.ZeroTerminated(name)))
	if alias != "" {
		req.AddData(nl.NewRtAttr(unix.IFLA_IFALIAS, []byte(alias)))
	}
	_, err := req.Execute(unix.NETLINK_ROUTE, 0)
	return err
}

// checkAddrs is CHECK's address test (as plugins' ip.ValidateExpectedInterfaceIPs):
// every address of want is on l with its prefix length, and the kernel has
// the prefix route for it.
func checkAddrs(l netlink.Link, want []*current.IPConfig) error {
	have, err := netlinksafe.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return fmt.Errorf("failed to list addresses: %w", err)
	}
	for _, ipc := range want {
		ours := netlink.Addr{IPNet: &ipc.Address}
		if !slices.ContainsFunc(have, func(a netlink.Addr) bool { return a.Equal(ours) }) {
			return fmt.Errorf("address %s is not configured", ipc.Address.String())
		}
		prefix := &net.IPNet{IP: ipc.Address.IP.Mask(ipc.Address.Mask), Mask: ipc.Address.Mask}
		family := netlink.FAMILY_V6
		if ipc.Address.IP.To4() != nil {
			family = netlink.FAMILY_V4
		}
		routes, err := netlinksafe.RouteListFiltered(family, &netlink.Route{Dst: prefix}, netlink.RT_FILTER_DST)
		if err != nil {
			return fmt.Errorf("failed to list routes to %s: %w", prefix, err)
		}
		if len(routes) == 0 {
			return fmt.Errorf("no route to the prefix %s of address %s", prefix, ipc.Address.String())
		}
	}
	return nil
}

func checkRoutes(l netlink.Link, prev *current.Result) error {
	routes, err := netlinksafe.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: l.Attrs().Index, Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
	if err != nil {
		return fmt.Errorf("failed to list routes of %q: %w", l.Attrs().Name, err)
	}
	fam := familiesOf(prev.IPs)
	for _, r := range prev.Routes {
		gw := r.GW
		if gw == nil {
			gw = fam.gateway(r.Dst.IP)
		}
		found := slices.ContainsFunc(routes, func(x netlink.Route) bool {
			dst := x.Dst
			if dst == nil {
				if r.Dst.IP.To4() != nil {
					dst = &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
				} else {
					dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
				}
			}
			return dst.String() == r.Dst.String() && x.Gw.Equal(gw)
		})
		if !found {
			return fmt.Errorf("route %s via %s is missing on %q", r.Dst.String(), gw, l.Attrs().Name)
		}
	}
	return nil
}

// Status implements CNI STATUS: spiderpool-agent healthy, then IPAM STATUS.
func (p *Plugin) Status(a *skel.CmdArgs) error {
	conf, err := config.Parse(a.StdinData)
	if err != nil {
		return err
	}
	client := p.DialSpiderpool(conf.SpiderpoolSocket)
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := client.Healthy(ctx); err != nil {
		return &types.Error{Code: types.ErrPluginNotAvailable, Msg: fmt.Sprintf("spiderpool-agent is not healthy: %v", err)}
	}
	if err := invoke.DelegateStatus(ctx, conf.IPAMConf.Type, a.StdinData, p.Exec); err != nil {
		if isIncompatible(err) {
			return nil
		}
		var te *types.Error
		if errors.As(err, &te) {
			return te
		}
		return &types.Error{Code: types.ErrPluginNotAvailable, Msg: fmt.Sprintf("IPAM %q STATUS failed: %v", conf.IPAMConf.Type, err)}
	}
	return nil
}

// GC implements CNI GC: delegated to IPAM (which frees reservations not in
// cni.dev/valid-attachments).
func (p *Plugin) GC(a *skel.CmdArgs) error {
	conf, err := config.ParseForDel(a.StdinData)
	if err != nil {
		return err
	}
	if unlock, err := lockState(conf.StateDir); err == nil {
		dropRecordsExcept(conf.StateDir, conf.ValidAttachments)
		unlock()
	}
	if err := invoke.DelegateGC(context.Background(), conf.IPAMConf.Type, a.StdinData, p.Exec); err != nil && !isIncompatible(err) {
		return fmt.Errorf("failed IPAM %q GC: %w", conf.IPAMConf.Type, err)
	}
	return nil
}

func isIncompatible(err error) bool {
	var te *types.Error
	return errors.As(err, &te) && te.Code == types.ErrIncompatibleCNIVersion
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
