package app

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"

	"aether.io/node/registry"
)

func TestParseFlags(t *testing.T) {
	c, err := ParseFlags([]string{"--allowed-uids", "0, 1000", "--system-namespaces", "a,b", "--locality", "r/z", "--node-name", "n1"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.AllowedUIDs) != 2 || c.AllowedUIDs[1] != 1000 || strings.Join(c.SystemNamespaces, ",") != "a,b" ||
		c.Locality != (registry.Locality{Region: "r", Zone: "z"}) || c.CNISocket != "/run/aether/agent/cni.sock" || c.NodeName != "n1" {
		t.Fatalf("config = %+v", c)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--allowed-uids", "root"}, "invalid --allowed-uids entry \"root\""},
		{[]string{"--allowed-uids", ""}, "at least one uid"},
		{[]string{"--locality", "a/b/c/d"}, "invalid --locality"},
		{[]string{"--node-name", ""}, "invalid --node-name"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"--liveness-interval", "0s"}, "must be positive"},
	} {
		if _, err := ParseFlags(tc.args, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseFlags(%q) = %v, want %q", tc.args, err, tc.want)
		}
	}
	var out bytes.Buffer
	if _, err := ParseFlags([]string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.Contains(out.String(), "-pod-manifests") {
		t.Fatalf("--help = %v:\n%s", err, out.String())
	}
}
