package enivlan

import (
	"encoding/json"
	"testing"
)

func TestIPAMStdinCapsVersion(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{"cniVersion":"1.1.0","name":"n","ipam":{"type":"spiderpool"}}`, "1.0.0"},
		{`{"cniVersion":"1.0.0","name":"n"}`, "1.0.0"},
		{`{"cniVersion":"0.4.0","name":"n"}`, "0.4.0"},
	}
	for _, tt := range tests {
		out, err := IPAMStdin([]byte(tt.in))
		if err != nil {
			t.Fatal(err)
		}
		var m struct {
			CNIVersion string         `json:"cniVersion"`
			IPAM       map[string]any `json:"ipam"`
		}
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatal(err)
		}
		if m.CNIVersion != tt.want {
			t.Errorf("IPAMStdin(%s) version %q, want %q", tt.in, m.CNIVersion, tt.want)
		}
	}
	out, err := IPAMStdin([]byte(`{"cniVersion":"1.1.0","prevResult":{"cniVersion":"1.1.0","ips":[]}}`))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Prev struct {
			CNIVersion string `json:"cniVersion"`
		} `json:"prevResult"`
	}
	if err := json.Unmarshal(out, &m); err != nil || m.Prev.CNIVersion != "1.0.0" {
		t.Errorf("prevResult not relabelled: %s", out)
	}
}
