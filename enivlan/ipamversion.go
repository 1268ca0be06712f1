package enivlan

import (
	"encoding/json"
	"fmt"

	"github.com/containernetworking/cni/pkg/version"
)

// IPAMMaxVersion is the highest cniVersion eni-vlan passes to its IPAM
// delegate for ADD, CHECK and DEL: spiderpool's IPAM accepts 0.3.0..1.0.0
// only, and the 1.0.0 and 1.1.0 result formats are identical, so a 1.1.0
// network gives IPAM 1.0.0. STATUS and GC exist only in 1.1.0 and are sent
// at 1.1.0; an IPAM that answers "incompatible CNI version" (code 1) to
// them is treated as not implementing them.
const IPAMMaxVersion = "1.0.0"

// IPAMStdin returns stdin with its cniVersion capped at IPAMMaxVersion.
func IPAMStdin(stdin []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(stdin, &m); err != nil {
		return nil, fmt.Errorf("failed to parse network configuration for IPAM: %w", err)
	}
	var v string
	_ = json.Unmarshal(m["cniVersion"], &v)
	if gt, err := version.GreaterThan(v, IPAMMaxVersion); err != nil || !gt {
		return stdin, nil
	}
	m["cniVersion"] = json.RawMessage(`"` + IPAMMaxVersion + `"`)
	if pr, ok := m["prevResult"]; ok {
		// The prevResult's format is the same at 1.0.0; label it so.
		var r map[string]json.RawMessage
		if err := json.Unmarshal(pr, &r); err == nil {
			r["cniVersion"] = m["cniVersion"]
			if b, err := json.Marshal(r); err == nil {
				m["prevResult"] = b
			}
		}
	}
	return json.Marshal(m)
}
