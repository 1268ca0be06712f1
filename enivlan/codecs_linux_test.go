package enivlan

import (
	"encoding/json"
	"net"
	"testing"

	current "github.com/containernetworking/cni/pkg/types/100"
)

// TestPrepareCodecs: the codec samples encode and decode at every CNI
// version eni-vlan speaks (a failure would only be logged by ADD, and the
// codecs built on first use).
func TestPrepareCodecs(t *testing.T) {
	for _, v := range SupportedVersions.SupportedVersions() {
		if err := prepareCodecs(v); err != nil {
			t.Errorf("prepareCodecs(%q): %v", v, err)
		}
	}
}

// TestEncodeResult: the result is one JSON object, the versioned result's
// keys plus ValidationKey.
func TestEncodeResult(t *testing.T) {
	_, n, _ := net.ParseCIDR("10.9.0.5/24")
	res := &current.Result{CNIVersion: "1.1.0", IPs: []*current.IPConfig{{Address: *n}}}
	for _, v := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		b, err := encodeResult(res, v, map[string]string{"ipv4": "ok"})
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatalf("%s: %q: %v", v, b, err)
		}
		if m["cniVersion"] != v || m[ValidationKey].(map[string]any)["ipv4"] != "ok" || len(m["ips"].([]any)) != 1 {
			t.Errorf("%s: %s", v, b)
		}
	}
}
