package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"testing"

	"aether.io/node/pkg/filelock"
)

// ReferencePluginsModule is the module the reference plugins come from; its
// version is the one go.mod pins.
const ReferencePluginsModule = "github.com/containernetworking/plugins"

// BinDirEnv names a directory holding prebuilt plugin and command binaries;
// when set, ReferencePlugins and BuildOwn use it and build nothing.
const BinDirEnv = "AETHER_CNI_BIN_DIR"

var referencePlugins = map[string]string{
	"host-local": "plugins/ipam/host-local",
	"static":     "plugins/ipam/static",
	"macvlan":    "plugins/main/macvlan",
	"bridge":     "plugins/main/bridge",
}

// ModuleRoot returns the directory of this module's go.mod.
func ModuleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// CacheDir returns the per-machine cache directory for test artefacts
// ($AETHER_TEST_CACHE, else ~/.cache/aether-node).
func CacheDir() string {
	if d := os.Getenv("AETHER_TEST_CACHE"); d != "" {
		return d
	}
	d, err := os.UserCacheDir()
	if err != nil {
		d = os.TempDir()
	}
	return filepath.Join(d, "aether-node")
}

func moduleVersion(path string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range bi.Deps {
			if m.Path == path {
				if m.Replace != nil {
					return m.Replace.Version
				}
				return m.Version
			}
		}
	}
	return "unknown"
}

// ReferencePlugins builds host-local, static, macvlan and bridge from
// containernetworking/plugins at the version go.mod pins into a cache
// directory (once per machine and version) and returns that directory.
//
// When AETHER_CNI_BIN_DIR is set (inside the VM lane, where there is no Go
// toolchain) that directory is returned instead and nothing is built.
func ReferencePlugins(tb testing.TB) string {
	tb.Helper()
	if d := os.Getenv(BinDirEnv); d != "" {
		return d
	}
	dir := filepath.Join(CacheDir(), "cni-plugins", moduleVersion(ReferencePluginsModule))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	unlock, err := lockDir(dir)
	if err != nil {
		tb.Fatal(err)
	}
	defer unlock()
	var missing []string
	for name, pkg := range referencePlugins {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			missing = append(missing, ReferencePluginsModule+"/"+pkg)
		}
	}
	if len(missing) > 0 {
		if err := goBuild(dir, missing...); err != nil {
			tb.Fatalf("failed to build reference plugins: %v", err)
		}
	}
	return dir
}

var (
	ownMu    sync.Mutex
	ownBuilt = map[string]string{}
	ownDir   string
)

// BuildOwn builds this module's commands (for example "eni-vlan" for
// ./cmd/eni-vlan) once per test process and returns the directory holding
// them. When AETHER_CNI_BIN_DIR is set, that directory is returned instead
// and nothing is built.
func BuildOwn(tb testing.TB, cmds ...string) string {
	tb.Helper()
	if d := os.Getenv(BinDirEnv); d != "" {
		return d
	}
	ownMu.Lock()
	defer ownMu.Unlock()
	dir := ownDirLocked(tb)
	var pkgs []string
	for _, c := range cmds {
		if _, ok := ownBuilt[c]; !ok {
			pkgs = append(pkgs, "./cmd/"+c)
		}
	}
	if len(pkgs) > 0 {
		if err := goBuild(dir, pkgs...); err != nil {
			tb.Fatalf("failed to build %v: %v", cmds, err)
		}
		for _, c := range cmds {
			ownBuilt[c] = filepath.Join(dir, c)
		}
	}
	return dir
}

// ownDirOf is ownDirLocked taking ownMu.
func ownDirOf(tb testing.TB) string {
	tb.Helper()
	ownMu.Lock()
	defer ownMu.Unlock()
	return ownDirLocked(tb)
}

// ownDirLocked returns the directory of the binaries this process builds
// (BuildOwn, BuildRelease, BuildReleaseArch), making it on first use; the
// caller holds ownMu.
func ownDirLocked(tb testing.TB) string {
	tb.Helper()
	if ownDir == "" {
		d, err := os.MkdirTemp("", "aether-bin-")
		if err != nil {
			tb.Fatal(err)
		}
		ownDir = d
	}
	return ownDir
}

// CleanupOwn removes the binaries BuildOwn made; Main calls it.
func CleanupOwn() {
	ownMu.Lock()
	defer ownMu.Unlock()
	if ownDir != "" {
		_ = os.RemoveAll(ownDir)
	}
}

var (
	releaseMu    sync.Mutex
	releaseBuilt = map[string]string{}
)

// ReleaseLDFLAGS are the linker flags of `make build`: release binaries
// carry no symbol table and no DWARF.
const ReleaseLDFLAGS = "-s -w"

// ReleaseTags are the build tags of `make build` (TAGS in the Makefile).
const ReleaseTags = "grpcnotrace"

// BuildRelease builds the Go package pkg (a path relative to the module
// root, for example "./cmd/aether-cni") the way `make build` builds the
// release binaries (CGO_ENABLED=0, -trimpath, -ldflags ReleaseLDFLAGS,
// -tags ReleaseTags), with the given build tags added, once per test process, installs
// it as a node gets it (a written copy of the linker's output, see install) and returns the
// binary's path (named after the package's last element). The binaries
// live in the directory BuildOwn uses and are removed by CleanupOwn. When
// AETHER_CNI_BIN_DIR is set, the binary of that name there is returned
// and nothing is built.
func BuildRelease(tb testing.TB, pkg string, tags ...string) string {
	tb.Helper()
	name := filepath.Base(pkg)
	if d := os.Getenv(BinDirEnv); d != "" {
		return filepath.Join(d, name)
	}
	key := pkg + "|" + strings.Join(tags, ",")
	releaseMu.Lock()
	defer releaseMu.Unlock()
	if p, ok := releaseBuilt[key]; ok {
		return p
	}
	dir := ownDirOf(tb)
	out := filepath.Join(dir, "release", fmt.Sprint(len(releaseBuilt)), name)
	linked := out + ".linked"
	args := []string{"build", "-trimpath", "-ldflags", ReleaseLDFLAGS, "-tags", strings.Join(append([]string{ReleaseTags}, tags...), ","), "-o", linked}
	if err := runGo(append(args, pkg)...); err != nil {
		tb.Fatalf("failed to build %s: %v", pkg, err)
	}
	if err := install(linked, out); err != nil {
		tb.Fatalf("failed to install %s: %v", pkg, err)
	}
	releaseBuilt[key] = out
	return out
}

// install writes a copy of the executable at linked to out and removes
// linked: a release binary reaches a node as a written file (the image
// layer, the CNI installer's copy into the host's bin directory), never as
// the linker's output. The Go linker writes its output through a shared
// memory mapping; an eni-vlan ADD exec'd from that file took about 1 ms
// more CPU than one exec'd from a copy of the same bytes (2026-12-01, 6.18
// kernel, ext4; the process faults its text in from the page cache the
// mapping left), a cost no node pays. Both sides of every exec benchmark
// are built here, so both are installed alike.
func install(linked, out string) error {
	b, err := os.ReadFile(linked)
	if err != nil {
		return err
	}
	if err := os.WriteFile(out, b, 0o755); err != nil {
		return err
	}
	return os.Remove(linked)
}

var (
	archMu    sync.Mutex
	archBuilt = map[string]string{}
)

// BuildReleaseArch builds the Go packages pkgs (paths relative to the
// module root, for example "./cmd/eni-vlan") for linux/goarch the way `make
// image` builds each architecture's release binaries (`make build`'s
// flags: CGO_ENABLED=0, -trimpath, -ldflags ReleaseLDFLAGS, -tags
// ReleaseTags), in one go build, once per test process, and returns the
// directory holding them (each named after its package's last element),
// in the directory BuildOwn uses (removed by CleanupOwn). Go's build cache
// makes a build of unchanged packages a link.
func BuildReleaseArch(tb testing.TB, goarch string, pkgs ...string) string {
	tb.Helper()
	args := []string{"build", "-trimpath", "-ldflags", ReleaseLDFLAGS, "-tags", ReleaseTags}
	return buildArch(tb, goarch, "release", func(dir string) []string {
		return append(append(args, "-o", dir+"/"), pkgs...)
	}, pkgs...)
}

// BuildTestArch compiles the tests of the Go package pkg (a path relative
// to the module root) for linux/goarch (go test -c, CGO_ENABLED=0), once
// per test process, and returns the test binary's path, in the directory
// BuildOwn uses.
func BuildTestArch(tb testing.TB, goarch, pkg string) string {
	tb.Helper()
	dir := buildArch(tb, goarch, "test", func(dir string) []string {
		return []string{"test", "-c", "-o", filepath.Join(dir, filepath.Base(pkg)+".test"), pkg}
	}, pkg)
	return filepath.Join(dir, filepath.Base(pkg)+".test")
}

// buildArch runs the go command args(dir) for linux/goarch into a new
// directory dir, once per kind, goarch and pkgs, and returns dir.
func buildArch(tb testing.TB, goarch, kind string, args func(dir string) []string, pkgs ...string) string {
	tb.Helper()
	key := kind + "|" + goarch + "|" + strings.Join(pkgs, ",")
	archMu.Lock()
	defer archMu.Unlock()
	if d, ok := archBuilt[key]; ok {
		return d
	}
	dir := filepath.Join(ownDirOf(tb), fmt.Sprintf("linux_%s-%d", goarch, len(archBuilt)))
	if err := runGoEnv([]string{"GOOS=linux", "GOARCH=" + goarch}, args(dir)...); err != nil {
		tb.Fatalf("failed to build %v for linux/%s: %v", pkgs, goarch, err)
	}
	archBuilt[key] = dir
	return dir
}

func goBuild(outDir string, pkgs ...string) error {
	return runGo(append([]string{"build", "-trimpath", "-o", outDir + "/"}, pkgs...)...)
}

func runGo(args ...string) error { return runGoEnv(nil, args...) }

// runGoEnv runs the go command with args in the module root, cgo off and
// env added to this process's environment.
func runGoEnv(env []string, args ...string) error {
	cmd := exec.Command("go", args...)
	cmd.Dir = ModuleRoot()
	cmd.Env = append(append(os.Environ(), "CGO_ENABLED=0"), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

func lockDir(dir string) (func(), error) {
	return filelock.Lock(filepath.Join(dir, ".lock"), 0o644)
}
