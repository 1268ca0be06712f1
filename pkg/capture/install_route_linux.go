package capture

import (
	"errors"
	"fmt"
	"net"
	"slices"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// loopbackIndex is lo's interface index in every network namespace (the
// kernel's LOOPBACK_IFINDEX, fixed since Linux 3.7): no lookup of lo by
// name, which costs a full RTM_GETLINK answer per call.
const loopbackIndex = 1

// localRoutes renders c's policy routing on lo (its index): per family, the
// local default route of the route table, and the fwmark rules that look
// it up (the divert mark, then the deliver mark).
func localRoutes(c Config) ([]*netlink.Route, []*netlink.Rule) {
	var routes []*netlink.Route
	var rules []*netlink.Rule
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
		scope := netlink.SCOPE_HOST
		if fam == unix.AF_INET6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
			scope = netlink.SCOPE_UNIVERSE
		}
		routes = append(routes, &netlink.Route{
			LinkIndex: loopbackIndex, Dst: dst, Table: c.RouteTable, Type: unix.RTN_LOCAL,
			Scope: scope, Family: fam,
		})
		for _, mark := range []uint32{c.DivertMark, c.DeliverMark} {
			rule := netlink.NewRule()
			rule.Family = fam
			rule.Mark = mark
			m := uint32(0xffffffff)
			rule.Mask = &m
			rule.Table = c.RouteTable
			rule.Priority = c.RulePriority
			rules = append(rules, rule)
		}
	}
	return routes, rules
}

// ipv6Disabled reports whether IPv6 is off in the namespace: lo (its
// index) then carries no ::1.
func ipv6Disabled(h netlinksafe.Handle) bool {
	link := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: loopbackIndex}}
	for range 5 {
		addrs, err := h.AddrList(link, unix.AF_INET6)
		if errors.Is(err, netlink.ErrDumpInterrupted) {
			continue
		}
		return err != nil || len(addrs) == 0
	}
	return true
}

// routing opens netlink on the namespace fd and renders c's local routes
// and fwmark rules there; the caller closes the handle.
func routing(fd int, c Config) (*netlinksafe.Handle, []*netlink.Route, []*netlink.Rule, error) {
	h, err := netlinksafe.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to open netlink in netns: %w", err)
	}
	routes, rules := localRoutes(c)
	return &h, routes, rules, nil
}

// installRouting puts c's local routes and fwmark rules in the namespace
// of fd and removes the divert's rules of an earlier configuration. The ip
// rules at the divert's priority are read once (one dump for both
// families): a rule already there is not added again, and the same list
// names the stale ones.
func installRouting(fd int, c Config) error {
	h, routes, rules, err := routing(fd, c)
	if err != nil {
		return err
	}
	defer h.Close()
	no6 := ipv6Disabled(*h)
	for _, rt := range routes {
		if rt.Family == unix.AF_INET6 && no6 {
			continue
		}
		if err := h.RouteReplace(rt); err != nil {
			return fmt.Errorf("failed to add local route to table %d: %w", c.RouteTable, err)
		}
	}
	have, err := rulesAt(*h, c.RulePriority)
	if err != nil {
		return err
	}
	for _, rule := range rules {
		if rule.Family == unix.AF_INET6 && no6 || slices.ContainsFunc(have, func(r netlink.Rule) bool { return sameRule(r, rule) }) {
			continue
		}
		if err := h.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("failed to add fwmark rule %#x lookup %d: %w", rule.Mark, c.RouteTable, err)
		}
	}
	return removeStale(*h, c, have, false)
}

// rulesAt lists the IPv4 and IPv6 ip rules at priority prio, in one dump.
func rulesAt(h netlinksafe.Handle, prio int) ([]netlink.Rule, error) {
	have, err := h.RuleListFiltered(unix.AF_UNSPEC, &netlink.Rule{Priority: prio}, netlink.RT_FILTER_PRIORITY)
	if err != nil {
		return nil, fmt.Errorf("failed to list ip rules: %w", err)
	}
	return slices.DeleteFunc(have, func(r netlink.Rule) bool {
		return r.Family != unix.AF_INET && r.Family != unix.AF_INET6
	}), nil
}

// sameRule reports whether the kernel's rule r is want: the same family,
// priority, full-mask fwmark and table, and no other selector.
func sameRule(r netlink.Rule, want *netlink.Rule) bool {
	return r.Family == want.Family && r.Priority == want.Priority && r.Mark == want.Mark &&
		r.Mask != nil && *r.Mask == *want.Mask && r.Table == want.Table && !r.Invert &&
		r.Src == nil && r.Dst == nil && r.IifName == "" && r.OifName == "" && r.Goto <= 0 &&
		r.TunID == 0 && r.IPProto == 0 && r.Dport == nil && r.Sport == nil && r.UIDRange == nil
}

// removeStale deletes, among have (the ip rules at c.RulePriority), the
// divert's fwmark rules left by an earlier configuration (another divert
// mark or route table), with the local default route of a table that only
// such a rule used; all includes the rules of c itself (Remove). A rule is
// the divert's when it sits at c.RulePriority, matches a full-mask fwmark
// and looks a table up.
func removeStale(h netlinksafe.Handle, c Config, have []netlink.Rule, all bool) error {
	var errs []error
	for i := range have {
		r := &have[i]
		divert := r.Priority == c.RulePriority && r.Mark != 0 && r.Mask != nil && *r.Mask == 0xffffffff && r.Table > 0 &&
			r.Table != unix.RT_TABLE_MAIN && r.Table != unix.RT_TABLE_LOCAL && r.Table != unix.RT_TABLE_DEFAULT
		ours := r.Table == c.RouteTable && (r.Mark == c.DivertMark || r.Mark == c.DeliverMark)
		if !divert || (!all && ours) {
			continue
		}
		if err := h.RuleDel(r); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("failed to delete stale fwmark rule %#x lookup %d: %w", r.Mark, r.Table, err))
			continue
		}
		if r.Table == c.RouteTable {
			continue
		}
		old := c
		old.RouteTable = r.Table
		routes, _ := localRoutes(old)
		for _, rt := range routes {
			if rt.Family != r.Family {
				continue
			}
			if err := h.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("failed to delete the local route of stale table %d: %w", r.Table, err))
			}
		}
	}
	return errors.Join(errs...)
}

func verifyRouting(fd int, c Config) error {
	h, err := netlinksafe.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("failed to open netlink in netns: %w", err)
	}
	defer h.Close()
	routes, rules := localRoutes(c)
	no6 := ipv6Disabled(h)
	for _, want := range rules {
		if want.Family == unix.AF_INET6 && no6 {
			continue
		}
		have, err := h.RuleListFiltered(want.Family, &netlink.Rule{Table: c.RouteTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("failed to list ip rules: %w", err)
		}
		found := false
		for _, r := range have {
			if r.Mark == want.Mark && r.Priority == want.Priority && r.Mask != nil && *r.Mask == *want.Mask {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("ip rule fwmark %#x lookup %d (family %d) missing", want.Mark, c.RouteTable, want.Family)
		}
	}
	for _, want := range routes {
		if want.Family == unix.AF_INET6 && no6 {
			continue
		}
		rt, err := h.RouteListFiltered(want.Family, &netlink.Route{Table: c.RouteTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("failed to list routes of table %d: %w", c.RouteTable, err)
		}
		found := false
		for _, r := range rt {
			if r.Type == unix.RTN_LOCAL && r.LinkIndex == want.LinkIndex && (r.Dst == nil || isDefault(r.Dst)) {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("local default route in table %d (family %d) missing", c.RouteTable, want.Family)
		}
	}
	return nil
}

func isDefault(n *net.IPNet) bool {
	ones, _ := n.Mask.Size()
	return ones == 0
}

func removeRouting(fd int, c Config) error {
	h, routes, rules, err := routing(fd, c)
	if err != nil {
		return err
	}
	defer h.Close()
	gone := func(err error) bool {
		return err == nil || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) || errors.Is(err, unix.EAFNOSUPPORT)
	}
	var errs []error
	for _, rule := range rules {
		if err := h.RuleDel(rule); !gone(err) {
			errs = append(errs, fmt.Errorf("failed to delete fwmark rule %#x lookup %d: %w", rule.Mark, c.RouteTable, err))
		}
	}
	for _, rt := range routes {
		if err := h.RouteDel(rt); !gone(err) {
			errs = append(errs, fmt.Errorf("failed to delete local route of table %d: %w", c.RouteTable, err))
		}
	}
	// Rules an earlier configuration left (a DEL with another netconf
	// than its ADD) go too.
	have, err := rulesAt(*h, c.RulePriority)
	if err == nil {
		err = removeStale(*h, c, have, true)
	}
	if err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
