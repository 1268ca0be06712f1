package chart

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"aether.io/node/pkg/filelock"
	"aether.io/node/test/harness"
)

// HelmVersion is the helm release every test and generator runs.
const HelmVersion = "v4.3.1"

// helmModule is the module of the helm command at HelmVersion.
const helmModule = "helm.sh/helm/v4"

// Helm returns the path of helm HelmVersion, building it with `go install`
// into harness.CacheDir()/tools/helm-<HelmVersion>/ when it is missing. The
// build runs under a file lock in that directory, so parallel test
// processes build once. A cold build (module download and compile) takes
// about 6 CPU-minutes, 17 minutes of wall time on a loaded 2-core machine,
// so a cold `go test ./deploy/...` needs a -timeout above the default 10m
// (`make test` gives 45m); a warm call is a stat.
func Helm() (string, error) {
	dir := filepath.Join(harness.CacheDir(), "tools", "helm-"+HelmVersion)
	bin := filepath.Join(dir, "helm")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("failed to create helm directory %q: %w", dir, err)
	}
	unlock, err := filelock.Lock(filepath.Join(dir, ".lock"), 0o644)
	if err != nil {
		return "", err
	}
	defer unlock()
	if _, err := os.Stat(bin); err == nil {
		return bin, nil // built by another process meanwhile
	}
	// Staging directories of builds killed midway (a test timeout) are
	// left over; nobody else builds while we hold the lock.
	if stale, err := filepath.Glob(filepath.Join(dir, "build-*")); err == nil {
		for _, d := range stale {
			_ = os.RemoveAll(d)
		}
	}
	// Build into a staging directory and rename: go install may copy the
	// binary across file systems, and a killed copy must never leave a
	// half-written helm where the next run would use it.
	stage, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return "", fmt.Errorf("failed to create helm build directory in %q: %w", dir, err)
	}
	defer func() { _ = os.RemoveAll(stage) }()
	cmd := exec.Command("go", "install",
		"-ldflags", "-s -w -X "+helmModule+"/internal/version.version="+HelmVersion,
		helmModule+"/cmd/helm@"+HelmVersion)
	cmd.Env = append(os.Environ(), "GOBIN="+stage, "CGO_ENABLED=0", "GOFLAGS=-buildvcs=false")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("failed to build helm %q: %w\n%s", HelmVersion, err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(filepath.Join(stage, "helm"), bin); err != nil {
		return "", fmt.Errorf("failed to install helm %q: %w", bin, err)
	}
	return bin, nil
}
