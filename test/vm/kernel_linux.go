package vm

import (
	"archive/tar"
	"bufio"
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"aether.io/node/test/harness"
)

// KernelMetaPackage is the Debian package whose dependency names the kernel
// image the lane boots.
const KernelMetaPackage = "linux-image-amd64"

// KernelDebEnv names a linux-image-*.deb to use instead of asking apt (for
// machines without the Debian archive; the cache is keyed by the package's
// own name and version either way).
const KernelDebEnv = "AETHER_VM_KERNEL_DEB"

// DefaultModules are the modules every VM loads (with their dependencies):
// 802.1Q VLANs, veth, and nf_tables with conntrack matching and reject.
// Modules the kernel has built in (af_packet, ipv6, the arp/inet/netdev
// nf_tables families, counter, lookup, payload, meta, immediate) need no
// loading and are accepted by name.
var DefaultModules = []string{
	"8021q", "veth",
	"nf_tables", "nft_ct", "nft_reject", "nft_reject_inet", "nft_reject_ipv4", "nft_reject_ipv6",
	"af_packet", "ipv6",
}

// Kernel is one Debian kernel image package unpacked into the cache: the
// uncompressed PVH vmlinux and an index of its modules.
type Kernel struct {
	// Package is the binary package name, for example linux-image-6.1.0-57-amd64.
	Package string
	// Version is the package version, for example 6.1.192-3.
	Version string
	// Release is the kernel release (the lib/modules directory name).
	Release string
	// Dir is the cache directory holding this kernel.
	Dir string
	// Vmlinux is the path of the uncompressed kernel with its PVH entry.
	Vmlinux string

	deb     string
	mu      sync.Mutex
	mods    map[string]moduleInfo // module name -> file and dependencies
	aliases map[string][]string   // plain alias (no wildcard) -> module names
	builtin map[string]bool
}

type moduleInfo struct {
	path    string   // in the package, for example lib/modules/R/kernel/net/8021q/8021q.ko
	depends []string // module names
	softpre []string // names or aliases of modules to load first (softdep pre:)
}

// indexFile is the cache's module index; the name changes with its format.
const indexFile = "modules.index.v2"

var (
	kernelMu    sync.Mutex
	kernelCache *Kernel
)

// FetchKernel returns the kernel that linux-image-amd64 currently depends
// on, downloading it with apt-get and unpacking it into
// <cache>/vm/kernel/<package>_<version> once per machine and version. It
// fails the test, naming what to install, when apt or the package cannot be
// had; it never skips.
func FetchKernel(tb testing.TB) *Kernel {
	tb.Helper()
	kernelMu.Lock()
	defer kernelMu.Unlock()
	if kernelCache != nil {
		return kernelCache
	}
	k, err := fetchKernel()
	if err != nil {
		tb.Fatalf("VM lane: %v", err)
	}
	kernelCache = k
	return k
}

func need(tools ...string) error {
	var missing []string
	for _, t := range tools {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing tools %v: install them with `apt-get install -y dpkg xz-utils zstd apt` (Debian)", missing)
	}
	return nil
}

func output(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("failed to run %s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// kernelPackage finds the linux-image-<release>-amd64 package and its
// candidate version.
func kernelPackage() (pkg, version string, err error) {
	if err := need("apt-cache", "apt-get"); err != nil {
		return "", "", err
	}
	out, err := output("apt-cache", "depends", KernelMetaPackage)
	if err != nil {
		return "", "", fmt.Errorf("%w (run `apt-get update` so apt knows %s)", err, KernelMetaPackage)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") && len(f[1]) > len("linux-image-") && f[1][len("linux-image-")] >= '0' && f[1][len("linux-image-")] <= '9' {
			pkg = f[1]
			break
		}
	}
	if pkg == "" {
		return "", "", fmt.Errorf("apt-cache depends %s names no linux-image-<release> package (run `apt-get update`; output: %q)", KernelMetaPackage, out)
	}
	out, err = output("apt-cache", "show", "--no-all-versions", pkg)
	if err != nil {
		return "", "", err
	}
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, "Version: "); ok {
			version = strings.TrimSpace(v)
		}
	}
	if version == "" {
		return "", "", fmt.Errorf("apt-cache show %s printed no Version", pkg)
	}
	return pkg, version, nil
}

func debField(deb, field string) (string, error) {
	out, err := output("dpkg-deb", "-f", deb, field)
	return strings.TrimSpace(out), err
}

func fetchKernel() (*Kernel, error) {
	if err := need("dpkg-deb", "xz"); err != nil {
		return nil, err
	}
	var pkg, version, deb string
	if d := os.Getenv(KernelDebEnv); d != "" {
		var err error
		if pkg, err = debField(d, "Package"); err != nil {
			return nil, err
		}
		if version, err = debField(d, "Version"); err != nil {
			return nil, err
		}
		deb = d
	} else {
		var err error
		if pkg, version, err = kernelPackage(); err != nil {
			return nil, err
		}
	}
	dir := filepath.Join(harness.CacheDir(), "vm", "kernel", pkg+"_"+strings.ReplaceAll(version, ":", "%3a"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("failed to create cache directory %q: %w", dir, err)
	}
	unlock, err := lockFile(filepath.Join(dir, ".lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()

	if deb == "" {
		deb = filepath.Join(dir, "kernel.deb")
		if _, err := os.Stat(deb); err != nil {
			if err := downloadDeb(pkg, version, dir, deb); err != nil {
				return nil, err
			}
		}
	}
	k := &Kernel{
		Package: pkg,
		Version: version,
		Release: strings.TrimPrefix(pkg, "linux-image-"),
		Dir:     dir,
		Vmlinux: filepath.Join(dir, "vmlinux"),
		deb:     deb,
	}
	if err := k.loadIndex(); err != nil {
		if err := k.unpack(); err != nil {
			return nil, err
		}
		if err := k.loadIndex(); err != nil {
			return nil, err
		}
	}
	return k, nil
}

func downloadDeb(pkg, version, dir, dst string) error {
	tmp, err := os.MkdirTemp(dir, "download-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	// apt drops privileges to _apt for the download; the directory must be
	// writable by it or apt warns and downloads unsandboxed.
	_ = os.Chmod(tmp, 0o777)
	cmd := exec.Command("apt-get", "download", pkg+"="+version)
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("failed to download the kernel package: apt-get download %s=%s: %w\n%s(the VM lane needs the Debian archive or %s=<path to linux-image-*.deb>)", pkg, version, err, out, KernelDebEnv)
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if len(debs) != 1 {
		return fmt.Errorf("apt-get download %s left %d .deb files in %s, want 1", pkg, len(debs), tmp)
	}
	return os.Rename(debs[0], dst)
}

// walkDeb streams the data archive of the .deb through fn.
func walkDeb(deb string, fn func(h *tar.Header, r io.Reader) error) error {
	cmd := exec.Command("dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("failed to run dpkg-deb --fsys-tarfile %s: %w", deb, err)
	}
	tr := tar.NewReader(bufio.NewReaderSize(stdout, 1<<20))
	var walkErr error
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			walkErr = fmt.Errorf("failed to read the data archive of %s: %w", deb, err)
			break
		}
		if err := fn(h, tr); err != nil {
			walkErr = err
			break
		}
	}
	_, _ = io.Copy(io.Discard, stdout)
	if err := cmd.Wait(); err != nil && walkErr == nil {
		walkErr = fmt.Errorf("dpkg-deb --fsys-tarfile %s: %w: %s", deb, err, stderr.String())
	}
	return walkErr
}

func moduleFile(name string) bool {
	return strings.HasSuffix(name, ".ko") || strings.HasSuffix(name, ".ko.xz") || strings.HasSuffix(name, ".ko.zst") || strings.HasSuffix(name, ".ko.gz")
}

// decompress undoes the compression a module or kernel payload may carry,
// chosen by its magic bytes; uncompressed data is returned as is.
func decompress(data []byte) ([]byte, error) {
	var cmd *exec.Cmd
	switch {
	case bytes.HasPrefix(data, []byte("\xfd7zXZ\x00")):
		cmd = exec.Command("xz", "-dc", "--single-stream")
	case bytes.HasPrefix(data, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		if err := need("zstd"); err != nil {
			return nil, err
		}
		cmd = exec.Command("zstd", "-dcq")
	case bytes.HasPrefix(data, []byte{0x1f, 0x8b}):
		cmd = exec.Command("gzip", "-dc")
	default:
		return data, nil
	}
	cmd.Stdin = bytes.NewReader(data)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil && len(out) == 0 {
		return nil, fmt.Errorf("failed to decompress with %s: %w: %s", cmd.Path, err, stderr.String())
	}
	return out, nil
}

// modinfo returns the key=value strings of a module's .modinfo section.
func modinfo(ko []byte) (map[string][]string, error) {
	f, err := elf.NewFile(bytes.NewReader(ko))
	if err != nil {
		return nil, fmt.Errorf("not an ELF module: %w", err)
	}
	s := f.Section(".modinfo")
	if s == nil {
		return nil, errors.New("module has no .modinfo section")
	}
	data, err := s.Data()
	if err != nil {
		return nil, err
	}
	info := map[string][]string{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if k, v, ok := strings.Cut(string(kv), "="); ok {
			info[k] = append(info[k], v)
		}
	}
	return info, nil
}

func modName(file string) string {
	base := path.Base(file)
	base = base[:strings.Index(base, ".ko")]
	return strings.ReplaceAll(base, "-", "_")
}

// unpack reads the package once: it writes the vmlinux, the kernel config
// and an index of every module's dependencies (Debian ships no modules.dep;
// depmod writes it at install time), taken from each module's .modinfo.
func (k *Kernel) unpack() error {
	modDir := "lib/modules/" + k.Release + "/"
	var index, builtin bytes.Buffer
	var gotKernel bool
	err := walkDeb(k.deb, func(h *tar.Header, r io.Reader) error {
		name := strings.TrimPrefix(h.Name, "./")
		switch {
		case name == "boot/vmlinuz-"+k.Release:
			data, err := io.ReadAll(r)
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(k.Dir, "vmlinuz"), data, 0o644); err != nil {
				return err
			}
			vmlinux, err := extractVmlinux(data)
			if err != nil {
				return fmt.Errorf("failed to extract vmlinux from %s: %w", name, err)
			}
			if err := writeAtomic(k.Vmlinux, vmlinux); err != nil {
				return err
			}
			gotKernel = true
		case name == "boot/config-"+k.Release:
			data, err := io.ReadAll(r)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(k.Dir, "config"), data, 0o644)
		case name == modDir+"modules.builtin":
			_, err := io.Copy(&builtin, r)
			return err
		case strings.HasPrefix(name, modDir) && moduleFile(name) && h.Typeflag == tar.TypeReg:
			data, err := io.ReadAll(r)
			if err != nil {
				return err
			}
			if data, err = decompress(data); err != nil {
				return fmt.Errorf("module %s: %w", name, err)
			}
			info, err := modinfo(data)
			if err != nil {
				return fmt.Errorf("module %s: %w", name, err)
			}
			mod := modName(name)
			if n := info["name"]; len(n) > 0 && n[0] != "" {
				mod = n[0]
			}
			deps := "-"
			if d := info["depends"]; len(d) > 0 && d[0] != "" {
				deps = d[0]
			}
			var pre []string
			for _, sd := range info["softdep"] {
				pre = append(pre, softdepPre(sd)...)
			}
			var aliases []string
			for _, a := range info["alias"] {
				if a != "" && !strings.ContainsAny(a, "*?[: ") {
					aliases = append(aliases, a)
				}
			}
			fmt.Fprintf(&index, "%s %s %s %s %s\n", mod, name, deps, list(pre), list(aliases))
		}
		return nil
	})
	if err != nil {
		return err
	}
	if !gotKernel {
		return fmt.Errorf("%s holds no boot/vmlinuz-%s", k.deb, k.Release)
	}
	if err := os.WriteFile(filepath.Join(k.Dir, "modules.builtin"), builtin.Bytes(), 0o644); err != nil {
		return err
	}
	// The index is written last: its presence marks a complete unpack.
	return writeAtomic(filepath.Join(k.Dir, indexFile), index.Bytes())
}

func list(l []string) string {
	if len(l) == 0 {
		return "-"
	}
	return strings.Join(l, ",")
}

func unlist(s string) []string {
	if s == "-" {
		return nil
	}
	return strings.Split(s, ",")
}

// softdepPre returns the "pre:" names of a softdep value such as
// "pre: crc32c post: foo".
func softdepPre(v string) []string {
	var out []string
	pre := false
	for _, w := range strings.Fields(v) {
		switch w {
		case "pre:":
			pre = true
		case "post:":
			pre = false
		default:
			if pre {
				out = append(out, w)
			}
		}
	}
	return out
}

func writeAtomic(dst string, data []byte) error {
	tmp := dst + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

func (k *Kernel) loadIndex() error {
	idx, err := os.ReadFile(filepath.Join(k.Dir, indexFile))
	if err != nil {
		return err
	}
	if _, err := os.Stat(k.Vmlinux); err != nil {
		return err
	}
	k.mods = map[string]moduleInfo{}
	k.aliases = map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(idx)), "\n") {
		f := strings.Fields(line)
		if len(f) != 5 {
			return fmt.Errorf("bad line in %s/%s: %q", k.Dir, indexFile, line)
		}
		k.mods[f[0]] = moduleInfo{path: f[1], depends: unlist(f[2]), softpre: unlist(f[3])}
		for _, a := range unlist(f[4]) {
			k.aliases[a] = append(k.aliases[a], f[0])
		}
	}
	for _, mods := range k.aliases {
		// Prefer the portable implementation (crc32c_generic over
		// crc32c_intel), then name order, so the choice is stable.
		sort.Slice(mods, func(i, j int) bool {
			gi, gj := strings.HasSuffix(mods[i], "_generic"), strings.HasSuffix(mods[j], "_generic")
			if gi != gj {
				return gi
			}
			return mods[i] < mods[j]
		})
	}
	k.builtin = map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(k.Dir, "modules.builtin")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if line = strings.TrimSpace(line); line != "" {
				k.builtin[modName(line)] = true
			}
		}
	}
	return nil
}

// extractVmlinux finds the compressed payload inside a bzImage and
// decompresses it. The result must be an ELF image with a PVH entry note,
// which qemu's microvm machine boots directly.
func extractVmlinux(bz []byte) ([]byte, error) {
	magics := [][]byte{[]byte("\xfd7zXZ\x00"), {0x28, 0xb5, 0x2f, 0xfd}, {0x1f, 0x8b, 0x08, 0x00}}
	for _, m := range magics {
		for off := 0; ; {
			i := bytes.Index(bz[off:], m)
			if i < 0 {
				break
			}
			out, err := decompress(bz[off+i:])
			if err == nil && bytes.HasPrefix(out, []byte("\x7fELF")) {
				if err := checkPVH(out); err != nil {
					return nil, err
				}
				return out, nil
			}
			off += i + 1
		}
	}
	return nil, errors.New("no xz, zstd or gzip payload holding an ELF kernel found in the bzImage")
}

// checkPVH looks for the Xen PHYS32_ENTRY note that marks a PVH entry point.
func checkPVH(vmlinux []byte) error {
	f, err := elf.NewFile(bytes.NewReader(vmlinux))
	if err != nil {
		return fmt.Errorf("the kernel payload is not ELF: %w", err)
	}
	const xenElfnotePhys32Entry = 18
	for _, p := range f.Progs {
		if p.Type != elf.PT_NOTE {
			continue
		}
		data, err := io.ReadAll(p.Open())
		if err != nil {
			continue
		}
		for len(data) >= 12 {
			namesz := binary.LittleEndian.Uint32(data[0:])
			descsz := binary.LittleEndian.Uint32(data[4:])
			typ := binary.LittleEndian.Uint32(data[8:])
			off := 12 + align4(namesz)
			if int(off) > len(data) {
				break
			}
			name := strings.TrimRight(string(data[12:12+namesz]), "\x00")
			if name == "Xen" && typ == xenElfnotePhys32Entry {
				return nil
			}
			next := off + align4(descsz)
			if int(next) > len(data) {
				break
			}
			data = data[next:]
		}
	}
	return errors.New("the kernel has no PVH entry note (CONFIG_PVH); qemu's microvm cannot boot it uncompressed")
}

func align4(n uint32) uint32 { return (n + 3) &^ 3 }

// ModuleFile is one module to load, in load order.
type ModuleFile struct {
	// Name is the module name.
	Name string
	// Path is the uncompressed .ko in the cache.
	Path string
}

// Modules resolves names with their dependencies into load order, unpacks
// the modules into the cache when they are not there yet, and returns them.
// Names the kernel has built in are accepted and need no file.
func (k *Kernel) Modules(names ...string) ([]ModuleFile, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(n string, from string) error
	visit = func(n, from string) error {
		n = strings.ReplaceAll(n, "-", "_")
		switch state[n] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", n)
		case 2:
			return nil
		}
		mi, ok := k.mods[n]
		if !ok {
			if k.builtin[n] {
				state[n] = 2
				return nil
			}
			if from != "" {
				return fmt.Errorf("module %s (needed by %s) is neither a module nor built into %s", n, from, k.Package)
			}
			return fmt.Errorf("module %s is neither a module nor built into %s", n, k.Package)
		}
		state[n] = 1
		// A soft pre-dependency (libcrc32c's "pre: crc32c") is what the
		// module requests at init through modprobe, which the guest lacks:
		// load it first. It may name an alias; it is skipped when nothing
		// provides it (as modprobe does).
		for _, sd := range mi.softpre {
			sd = strings.ReplaceAll(sd, "-", "_")
			if _, ok := k.mods[sd]; !ok {
				if a := k.aliases[sd]; len(a) > 0 {
					sd = a[0]
				} else if a := k.aliases[strings.ReplaceAll(sd, "_", "-")]; len(a) > 0 {
					sd = a[0]
				} else {
					continue
				}
			}
			if err := visit(sd, n); err != nil {
				return err
			}
		}
		for _, d := range mi.depends {
			if err := visit(d, n); err != nil {
				return err
			}
		}
		state[n] = 2
		order = append(order, n)
		return nil
	}
	for _, n := range names {
		if err := visit(n, ""); err != nil {
			return nil, err
		}
	}
	want := map[string]string{} // package path -> cache path
	var out []ModuleFile
	for _, n := range order {
		p := k.mods[n].path
		dst := filepath.Join(k.Dir, "modules", n+".ko")
		if _, err := os.Stat(dst); err != nil {
			want[p] = dst
		}
		out = append(out, ModuleFile{Name: n, Path: dst})
	}
	if len(want) > 0 {
		if err := k.extract(want); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (k *Kernel) extract(want map[string]string) error {
	unlock, err := lockFile(filepath.Join(k.Dir, ".lock"))
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.MkdirAll(filepath.Join(k.Dir, "modules"), 0o755); err != nil {
		return err
	}
	left := maps.Clone(want)
	err = walkDeb(k.deb, func(h *tar.Header, r io.Reader) error {
		name := strings.TrimPrefix(h.Name, "./")
		dst, ok := want[name]
		if !ok {
			return nil
		}
		data, err := io.ReadAll(r)
		if err != nil {
			return err
		}
		if data, err = decompress(data); err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		delete(left, name)
		return writeAtomic(dst, data)
	})
	if err != nil {
		return err
	}
	if len(left) > 0 {
		var l []string
		for p := range left {
			l = append(l, p)
		}
		sort.Strings(l)
		return fmt.Errorf("modules %v not found in %s", l, k.deb)
	}
	return nil
}

// Builtin reports whether the kernel has the named module built in.
func (k *Kernel) Builtin(name string) bool {
	return k.builtin[strings.ReplaceAll(name, "-", "_")]
}

// HasModule reports whether the package ships the named module.
func (k *Kernel) HasModule(name string) bool {
	_, ok := k.mods[strings.ReplaceAll(name, "-", "_")]
	return ok
}
