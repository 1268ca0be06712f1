package enivlan

import (
	"net"
	"net/netip"

	current "github.com/containernetworking/cni/pkg/types/100"

	"aether.io/node/enivlan/spiderpool"
)

// families splits IPAM's addresses by family: the first address of each
// family is the one eni-vlan asks spiderpool-agent about and probes from,
// and the first gateway of each family is the family's gateway (the probe
// target, and the next hop of a route that names none). ADD and CHECK both
// decide this here and nowhere else.
type families struct {
	v4, v6   *current.IPConfig
	gw4, gw6 net.IP
}

func familiesOf(ips []*current.IPConfig) families {
	var f families
	for _, c := range ips {
		if c.Address.IP.To4() != nil {
			if f.v4 == nil {
				f.v4 = c
			}
			if f.gw4 == nil {
				f.gw4 = c.Gateway
			}
			continue
		}
		if f.v6 == nil {
			f.v6 = c
		}
		if f.gw6 == nil {
			f.gw6 = c.Gateway
		}
	}
	return f
}

// gateway is the next hop of a route to dst that names none.
func (f families) gateway(dst net.IP) net.IP {
	if dst.To4() != nil {
		return f.gw4
	}
	return f.gw6
}

// query returns q with the family addresses IPAM allocated.
func (f families) query(q spiderpool.Query) spiderpool.Query {
	if f.v4 != nil {
		q.IPv4, _ = netip.AddrFromSlice(f.v4.Address.IP.To4())
	}
	if f.v6 != nil {
		q.IPv6, _ = netip.AddrFromSlice(f.v6.Address.IP.To16())
	}
	return q
}

// family is one address family as the pre-flight sees it.
type family struct {
	name string
	addr *current.IPConfig
	gw   net.IP
}

// each returns the two families in probe order (IPv4, then IPv6).
func (f families) each() []family {
	return []family{{"ipv4", f.v4, f.gw4}, {"ipv6", f.v6, f.gw6}}
}
