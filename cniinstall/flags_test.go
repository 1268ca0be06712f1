package cniinstall

import (
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestParseFlags(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "entry.json")
	if err := os.WriteFile(conf, []byte("{\n  \"type\": \"aether-cni\",\n  \"agent_socket\": \"/x.sock\"\n}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		args     []string
		binaries []string
		entry    string
	}{
		{
			"defaults", nil,
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","capture":{"redirect_all":true},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"eni-vlan and entry flags",
			[]string{"--install-eni-vlan", "--agent-socket=/a.sock", "--netns-pin-dir=/pins", "--redirect-all=false", "--plugin-log-level=debug", "--capture-failure=open"},
			[]string{"aether-cni", "eni-vlan"},
			`{"type":"aether-cni","agent_socket":"/a.sock","netns_pin_dir":"/pins","capture":{},"capture_failure":"open","log_level":"debug","capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"k3s's CRI socket",
			[]string{"--cri-socket=unix:///run/k3s/containerd/containerd.sock"},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","cri_socket":"unix:///run/k3s/containerd/containerd.sock","capture":{"redirect_all":true},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"no CRI lookup",
			[]string{"--cri-socket=none"},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","cri_socket":"","capture":{"redirect_all":true},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"inbound redirect",
			[]string{"--inbound-capture", "--inbound-plaintext-allow-cidrs=10.88.0.1, fd00::/64"},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","capture":{"redirect_all":true,"inbound_capture":true,"inbound_plaintext_allow_cidrs":["10.88.0.1","fd00::/64"]},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"another HBONE port",
			[]string{"--hbone-port=15009"},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","capture":{"redirect_all":true,"hbone_port":15009},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"Istio's HBONE port is the default, left out",
			[]string{"--hbone-port=15008"},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/run/aether/agent/cni.sock","netns_pin_dir":"/run/aether/netns","capture":{"redirect_all":true},"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`,
		},
		{
			"plugin config file, compacted",
			[]string{"--plugin-config=" + conf},
			[]string{"aether-cni"},
			`{"type":"aether-cni","agent_socket":"/x.sock"}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := ParseFlags(tc.args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(o.Config.Binaries, tc.binaries) || string(o.Config.Entry) != tc.entry {
				t.Fatalf("binaries %v entry %s; want %v %s", o.Config.Binaries, o.Config.Entry, tc.binaries, tc.entry)
			}
			if o.Config.UninstallOnExit != UninstallAuto {
				t.Fatalf("uninstall on exit %q, want auto by default", o.Config.UninstallOnExit)
			}
			if o.Config.BinDir != DefaultBinDir || o.Config.ConfDir != DefaultConfDir || o.Config.StateFile != DefaultStateFile || o.LogLevel != "info" {
				t.Fatalf("defaults not applied: %+v", o)
			}
		})
	}
	for _, bad := range [][]string{{"--plugin-log-level=loud"}, {"--netns-pin-dir=rel"}, {"--plugin-config=/nonexistent"}, {"--log-level=trace"}, {"--uninstall-on-exit=sometimes"}, {"--capture-failure=ignore"}, {"--inbound-plaintext-allow-cidrs=node"}, {"--cri-socket=/run/containerd/containerd.sock"}, {"--cri-socket=unix://run/x.sock"}, {"--cri-socket=unix:///run/../x.sock"}} {
		if _, err := ParseFlags(bad, io.Discard); err == nil {
			t.Errorf("ParseFlags(%v) succeeded; want an error", bad)
		}
	}
}
