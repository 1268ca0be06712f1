package enivlan

import (
	"encoding/json"
	"fmt"
	"net"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/types/create"
	"github.com/containernetworking/cni/pkg/version"

	"aether.io/node/enivlan/spiderpool"
)

// encodeResult encodes res as version ver with ValidationKey added: the
// result is marshalled once and the key appended to its JSON object.
func encodeResult(res *current.Result, ver string, validation map[string]string) ([]byte, error) {
	r, err := res.GetAsVersion(ver)
	if err != nil {
		return nil, fmt.Errorf("failed to convert result to version %s: %w", ver, err)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("failed to encode the result: %w", err)
	}
	v, err := json.Marshal(map[string]map[string]string{ValidationKey: validation})
	if err != nil {
		return nil, fmt.Errorf("failed to encode the result: %w", err)
	}
	if len(b) < 2 || b[0] != '{' || b[len(b)-1] != '}' {
		return nil, fmt.Errorf("failed to encode the result: %.64q is not a JSON object", b)
	}
	out := b[:len(b)-1]
	if len(out) > 1 {
		out = append(out, ',')
	}
	return append(out, v[1:]...), nil
}

// prepareCodecs has encoding/json build, in this process, the decoders and
// encoders of everything ADD decodes and encodes once the IPAM delegate has
// answered: the delegate's result (at the version the delegate is given),
// spiderpool-agent's answer, the ownership record and the ADD result (at
// ver, with ValidationKey). encoding/json builds them on a type's first use
// and caches them for the process; a fresh plugin process otherwise builds
// each on its critical path, 0.1-0.2 ms apiece (README.md, "Performance
// notes"). ADD runs it on another goroutine while it waits for the
// delegate. It encodes and decodes a sample of each, with an element in
// every list, so that the element types' codecs are built too; nothing it
// makes is kept.
func prepareCodecs(ver string) error {
	ipamVer := ver
	if gt, err := version.GreaterThan(ver, IPAMMaxVersion); err == nil && gt {
		ipamVer = IPAMMaxVersion
	}
	_, addr, _ := net.ParseCIDR("192.0.2.2/24")
	addr.IP = net.IPv4(192, 0, 2, 2)
	sample := &current.Result{
		CNIVersion: current.ImplementedSpecVersion,
		Interfaces: []*current.Interface{{Name: "eth0", Mac: "02:00:00:00:00:01", Mtu: 1500, Sandbox: "/proc/1/ns/net"}},
		IPs:        []*current.IPConfig{{Interface: current.Int(0), Address: *addr, Gateway: net.IPv4(192, 0, 2, 1)}},
		Routes:     []*types.Route{{Dst: net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}, GW: net.IPv4(192, 0, 2, 1)}},
		DNS:        types.DNS{Nameservers: []string{"192.0.2.53"}, Domain: "example", Search: []string{"example"}, Options: []string{"ndots:5"}},
	}
	// The delegate's result, decoded as invoke decodes it.
	r, err := sample.GetAsVersion(ipamVer)
	if err != nil {
		return fmt.Errorf("failed to convert the codec sample to version %s: %w", ipamVer, err)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("failed to encode the codec sample: %w", err)
	}
	if _, err := create.Create(ipamVer, b); err != nil {
		return fmt.Errorf("failed to decode the codec sample: %w", err)
	}
	if err := spiderpool.PrepareDecoder(); err != nil {
		return err
	}
	if _, err := json.Marshal(&record{}); err != nil {
		return fmt.Errorf("failed to encode the codec sample record: %w", err)
	}
	_, err = encodeResult(sample, ver, map[string]string{"ipv4": ""})
	return err
}
