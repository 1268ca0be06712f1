package cniinstall

import (
	"encoding/json"
	"os"
	"reflect"
	"testing"

	"aether.io/node/meshcni"
)

// TestDefaultEntry: the entry the installer chains by default is the one
// deploy/cni ships and aether-cni parses it to its own defaults.
func TestDefaultEntry(t *testing.T) {
	opts, err := ParseFlags(nil, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	entry := opts.Config.Entry
	var got map[string]any
	if err := json.Unmarshal(entry, &got); err != nil {
		t.Fatal(err)
	}
	deploy, err := os.ReadFile("../deploy/cni/10-aether.conflist")
	if err != nil {
		t.Fatal(err)
	}
	var l struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(deploy, &l); err != nil {
		t.Fatal(err)
	}
	var want map[string]any
	for _, p := range l.Plugins {
		if p["type"] == PluginType {
			want = p
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("default entry %s differs from deploy/cni's aether-cni entry %v", entry, want)
	}
	// As the runtime hands it to the plugin: name and cniVersion injected.
	got["cniVersion"], got["name"] = "1.0.0", "aether"
	netconf, err := json.Marshal(got)
	if err != nil {
		t.Fatal(err)
	}
	c, err := meshcni.ParseConfig(netconf, false)
	if err != nil {
		t.Fatalf("aether-cni rejects the default entry: %v", err)
	}
	if c.AgentSocket != meshcni.DefaultAgentSocket || DefaultAgentSocket != meshcni.DefaultAgentSocket {
		t.Fatalf("agent socket %q, installer default %q; want meshcni's %q", c.AgentSocket, DefaultAgentSocket, meshcni.DefaultAgentSocket)
	}
	if c.PinDir != meshcni.DefaultPinDir || DefaultPinDir != meshcni.DefaultPinDir {
		t.Fatalf("pin dir %q, installer default %q; want meshcni's %q", c.PinDir, DefaultPinDir, meshcni.DefaultPinDir)
	}
	if !c.Capture.RedirectAll {
		t.Fatal("default entry does not redirect all ports")
	}
}
