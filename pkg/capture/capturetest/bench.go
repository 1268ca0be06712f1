package capturetest

// What the capture and meshcni comparison benchmarks share: the
// per-operation latency recorder that reports p50-ns and p99-ns, and the
// Istio-equivalent in-pod ruleset the peer installs with `nft -f`.

import (
	"slices"
	"testing"
	"time"
)

// Latencies records one duration per operation.
type Latencies []time.Duration

// Report adds p50-ns and p99-ns to b.
func (l Latencies) Report(b *testing.B) {
	if len(l) == 0 {
		return
	}
	s := slices.Clone(l)
	slices.Sort(s)
	pct := func(p float64) float64 {
		i := int(p * float64(len(s)-1))
		return float64(s[i].Nanoseconds())
	}
	b.ReportMetric(pct(0.50), "p50-ns")
	b.ReportMetric(pct(0.99), "p99-ns")
}

// IstioInPodRuleset is an nftables rendering, at Istio ambient's size, of
// the in-pod rules istio-cni installs (inet tables istio-ambient-mangle and
// istio-ambient-nat; ztunnel mark 0x539/0xfff, connmark 0x111, probe SNAT
// address, ports 15001/15006/15008), as its nftables backend feeds `nft -f`.
const IstioInPodRuleset = `table inet istio-ambient-mangle {
	chain prerouting {
		type filter hook prerouting priority mangle; policy accept;
		jump istio-prerouting
	}
	chain output {
		type route hook output priority mangle; policy accept;
		jump istio-output
	}
	chain istio-prerouting {
		meta mark & 0x00000fff == 0x00000539 ct mark set ct mark & 0xfffff000 | 0x00000111
	}
	chain istio-output {
		ct mark & 0x00000fff == 0x00000111 meta mark set ct mark
	}
}
table inet istio-ambient-nat {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		jump istio-prerouting
	}
	chain output {
		type nat hook output priority -100; policy accept;
		jump istio-output
	}
	chain istio-prerouting {
		ip saddr 169.254.7.127 meta l4proto tcp accept
		ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff meta l4proto tcp accept
		meta l4proto tcp ip daddr != 127.0.0.1 tcp dport != 15008 meta mark & 0x00000fff != 0x00000539 redirect to :15006
		meta l4proto tcp ip6 daddr != ::1 tcp dport != 15008 meta mark & 0x00000fff != 0x00000539 redirect to :15006
	}
	chain istio-output {
		ip daddr 169.254.7.127 meta l4proto tcp accept
		ip6 daddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff meta l4proto tcp accept
		meta l4proto tcp ct mark & 0x00000fff == 0x00000111 accept
		oifname "lo" ip daddr != 127.0.0.1 accept
		oifname "lo" ip6 daddr != ::1 accept
		ip daddr != 127.0.0.1 meta l4proto tcp meta mark & 0x00000fff != 0x00000539 redirect to :15001
		ip6 daddr != ::1 meta l4proto tcp meta mark & 0x00000fff != 0x00000539 redirect to :15001
	}
}
`
