package enivlantest

// BenchIP is the address StaticIPAM hands out (one pod at a time), in the
// cloud's IPv4 subnet.
const BenchIP = "10.77.0.60/24"

// StaticIPAM is the static IPAM section the benchmarks delegate to (eni-vlan
// and its peers alike): BenchIP, gateway 10.77.0.1, default route.
func StaticIPAM() map[string]any {
	return map[string]any{
		"type":      "static",
		"addresses": []map[string]any{{"address": BenchIP, "gateway": "10.77.0.1"}},
		"routes":    []map[string]any{{"dst": "0.0.0.0/0"}},
	}
}
