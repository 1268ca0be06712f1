package enivlan_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
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
