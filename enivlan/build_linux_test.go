package enivlan_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/enivlan/preflight"
	"aether.io/node/test/harness"
)

func version(t *testing.T, dir string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(dir, "eni-vlan"))
	cmd.Env = append(os.Environ(), "CNI_COMMAND=VERSION", enivlan.LogFileEnv+"="+filepath.Join(t.TempDir(), "log"))
	cmd.Stdin = strings.NewReader(`{"cniVersion":"1.1.0"}`)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("VERSION: %v", err)
	}
	return string(out)
}

// TestSurrogateOnlyByTag: the production build (no tag) never carries the
// surrogate; the tagged build says so in VERSION.
func TestSurrogateOnlyByTag(t *testing.T) {
	harness.RequireRoot(t)
	prod := version(t, harness.BuildOwn(t, "eni-vlan"))
	if strings.Contains(prod, "surrogate") || strings.Contains(prod, enivlan.BuildKey) {
		t.Errorf("production VERSION mentions the surrogate: %s", prod)
	}
	if !strings.Contains(prod, `"supportedVersions":["0.4.0","1.0.0","1.1.0"]`) {
		t.Errorf("production VERSION: %s", prod)
	}
	sur := version(t, enivlantest.BuildSurrogate(t))
	if !strings.Contains(sur, enivlan.BuildKey) || !strings.Contains(sur, "NOT 802.1Q VLANs") {
		t.Errorf("surrogate VERSION does not say so: %s", sur)
	}
}

// TestCloserSkipsPluginInit: the production binary started as a socket
// closer runs closerproc's init and exits before the plugin's other package
// initialisers (inittrace lists every init that ran), so a closer costs a
// bare Go runtime start; an import added to closerproc that pulls a heavy
// package in front of it fails here.
func TestCloserSkipsPluginInit(t *testing.T) {
	harness.RequireRoot(t)
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = devNull.Close() })
	cmd := exec.Command(filepath.Join(harness.BuildOwn(t, "eni-vlan"), "eni-vlan"))
	cmd.Env = []string{preflight.CloserEnv + "=1", "GODEBUG=inittrace=1"}
	cmd.ExtraFiles = []*os.File{devNull} // descriptor 3: recvmsg fails at once, the closer exits
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("closer: %v\n%s", err, out)
	}
	var inits []string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "init" {
			inits = append(inits, f[1])
		}
	}
	if len(inits) == 0 {
		t.Fatalf("no inittrace output:\n%s", out)
	}
	for _, heavy := range []string{"net/http", "net", "crypto/x509", "github.com/vishvananda/netlink", "github.com/containernetworking/cni/pkg/skel", "aether.io/node/enivlan"} {
		if slices.Contains(inits, heavy) {
			t.Errorf("the closer ran the init of %s; inits: %v", heavy, inits)
		}
	}
}
