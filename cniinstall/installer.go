package cniinstall

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Defaults of Config.
const (
	// DefaultBinDir is the host's CNI bin dir.
	DefaultBinDir = "/opt/cni/bin"
	// DefaultConfDir is the host's CNI conf dir.
	DefaultConfDir = "/etc/cni/net.d"
	// DefaultStateFile is outside the conf dir, on a host path that
	// survives pod restarts.
	DefaultStateFile = "/var/lib/aether/cni-install/state.json"
	// DefaultDebounce coalesces a burst of conf dir events.
	DefaultDebounce = 50 * time.Millisecond
	// DefaultMaxBackoff bounds the wait between repairs when another
	// writer keeps removing aether-cni.
	DefaultMaxBackoff = 30 * time.Second
	// DefaultResync re-checks the chain even without events.
	DefaultResync = time.Minute
	// DefaultFightWindow: see Config.FightWindow.
	DefaultFightWindow = 2 * time.Second
)

// Config is the installer's configuration.
type Config struct {
	// BinDir is the host's CNI bin dir the binaries are copied into.
	BinDir string
	// ConfDir is the host's CNI conf dir holding the primary.
	ConfDir string
	// SourceDir holds the binaries in the image.
	SourceDir string
	// Binaries are the file names copied from SourceDir to BinDir.
	Binaries []string
	// Entry is the aether-cni plugin object chained into the primary.
	Entry []byte
	// StateFile records what to restore; it must be outside ConfDir.
	StateFile string
	// Debounce, MaxBackoff and Resync: see the defaults (0 = default).
	Debounce, MaxBackoff, Resync time.Duration
	// FightWindow: a repair this soon after the previous one means another
	// writer keeps removing aether-cni, and the next repair waits an
	// exponentially growing backoff (0 = DefaultFightWindow).
	FightWindow time.Duration
	// UninstallOnExit says whether a stop (SIGTERM) uninstalls ("" =
	// UninstallAuto; see keepOnExit).
	UninstallOnExit UninstallMode
	// Owner answers UninstallAuto's question; nil outside a Kubernetes pod
	// (auto then uninstalls).
	Owner OwnerChecker
	// OwnerTimeout bounds Owner's answer (0 = DefaultOwnerTimeout).
	OwnerTimeout time.Duration
	// ReadyFile, when set, exists exactly while the last reconcile found
	// aether-cni chained (by us or foreign); the DaemonSet's startup probe
	// (--check-ready) waits for it, so the agent starts, and removes the
	// node's not-ready taint, only once pods on the node are captured.
	ReadyFile string
}

// Outcome is what one Reconcile did.
type Outcome int

// Outcomes of Reconcile.
const (
	// Unchanged: the primary already chains aether-cni.
	Unchanged Outcome = iota
	// Chained: aether-cni was added to a primary for the first time.
	Chained
	// Repaired: the primary was rewritten without aether-cni and the
	// chain was put back.
	Repaired
	// NoPrimary: the conf dir holds no valid network configuration yet.
	NoPrimary
	// Foreign: the primary has an aether-cni entry the installer did not
	// add; it is left alone and never removed.
	Foreign
)

// String names the outcome for logs.
func (o Outcome) String() string {
	switch o {
	case Unchanged:
		return "unchanged"
	case Chained:
		return "chained"
	case Repaired:
		return "repaired"
	case NoPrimary:
		return "no_primary"
	case Foreign:
		return "foreign"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Installer installs, repairs and uninstalls aether-cni on one node. Its
// methods are not safe for concurrent use; Run serialises them.
type Installer struct {
	cfg Config
	log *slog.Logger
}

// New validates cfg and returns an installer; it does no I/O.
func New(cfg Config, log *slog.Logger) (*Installer, error) {
	if cfg.BinDir == "" || cfg.ConfDir == "" || cfg.SourceDir == "" || cfg.StateFile == "" {
		return nil, errors.New("invalid installer config: bin dir, conf dir, source dir and state file are required")
	}
	for _, p := range []string{cfg.BinDir, cfg.ConfDir, cfg.SourceDir, cfg.StateFile} {
		if !filepath.IsAbs(p) {
			return nil, fmt.Errorf("invalid path %q: must be absolute", p)
		}
	}
	if rel, err := filepath.Rel(filepath.Clean(cfg.ConfDir), filepath.Clean(cfg.StateFile)); err == nil && filepath.IsLocal(rel) {
		return nil, fmt.Errorf("invalid state file %q: must be outside the conf dir %q so the runtime never reads it", cfg.StateFile, cfg.ConfDir)
	}
	for _, b := range cfg.Binaries {
		if b == "" || filepath.Base(b) != b {
			return nil, fmt.Errorf("invalid binary name %q: must be a plain file name in the source dir", b)
		}
	}
	if err := ValidateEntry(cfg.Entry); err != nil {
		return nil, err
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = DefaultDebounce
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.Resync <= 0 {
		cfg.Resync = DefaultResync
	}
	if cfg.FightWindow <= 0 {
		cfg.FightWindow = DefaultFightWindow
	}
	if cfg.UninstallOnExit == "" {
		cfg.UninstallOnExit = UninstallAuto
	}
	if _, err := ParseUninstallMode(string(cfg.UninstallOnExit)); err != nil {
		return nil, err
	}
	if cfg.OwnerTimeout <= 0 {
		cfg.OwnerTimeout = DefaultOwnerTimeout
	}
	return &Installer{cfg: cfg, log: log}, nil
}

// ValidateEntry checks that entry is one JSON object with "type" aether-cni.
func ValidateEntry(entry []byte) error {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(entry, &obj); err != nil {
		return fmt.Errorf("invalid aether-cni plugin config %q: must be a JSON object: %w", entry, err)
	}
	var typ string
	if err := json.Unmarshal(obj["type"], &typ); err != nil || typ != PluginType {
		return fmt.Errorf("invalid aether-cni plugin config %q: \"type\" must be %q", entry, PluginType)
	}
	return nil
}

// InstallBinaries copies every configured binary into the bin dir,
// skipping the ones already identical.
func (i *Installer) InstallBinaries() error {
	for _, b := range i.cfg.Binaries {
		dst := filepath.Join(i.cfg.BinDir, b)
		wrote, err := CopyBinary(filepath.Join(i.cfg.SourceDir, b), dst)
		if err != nil {
			return err
		}
		i.log.Info("plugin binary installed", "path", dst, "written", wrote)
	}
	return nil
}

// RemoveBinaries removes the binaries the installer copied (those still
// identical to the source).
func (i *Installer) RemoveBinaries() error {
	var errs []error
	for _, b := range i.cfg.Binaries {
		dst := filepath.Join(i.cfg.BinDir, b)
		removed, err := RemoveBinary(filepath.Join(i.cfg.SourceDir, b), dst)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if removed {
			i.log.Info("plugin binary removed", "path", dst)
		} else {
			i.log.Info("plugin binary left in place: missing, or not the one the installer copied", "path", dst)
		}
	}
	return errors.Join(errs...)
}

// Reconcile makes the runtime's primary chain aether-cni as its last
// plugin: it chains a new primary, repairs one rewritten without
// aether-cni (or whose chain no longer ends with it), and releases a
// previous primary that is no longer the first file. It is idempotent.
func (i *Installer) Reconcile() (Outcome, error) {
	out, p, err := i.reconcile()
	if err == nil && (out == Unchanged || out == Foreign) && !chainEndsWith(p.List) {
		// Only an entry the installer did not write can end up here: its
		// own is the last plugin by construction (the plugin directory's
		// last file when libcni loads one, else the last inline plugin).
		i.log.Warn("aether-cni is not the last plugin of the runtime's chain; the entry is not the installer's, left as it is", "primary", p.Path, "plugins", strings.Join(ChainTypes(p.List), ","))
	}
	return out, err
}

func (i *Installer) reconcile() (Outcome, *Primary, error) {
	st, err := loadState(i.cfg.StateFile)
	if err != nil {
		return Unchanged, nil, err
	}
	p, err := i.findPrimary()
	if err != nil || p == nil {
		return NoPrimary, nil, err
	}
	layout, err := i.layoutFor(p, st)
	if err != nil {
		return Unchanged, nil, err
	}
	if st != nil {
		if why := stale(st, p, layout); why != "" {
			// A new lexically-first file, the single-plugin original
			// back next to our conflist, a retargeted symlink, or a
			// plugin directory that now decides what is last: give the
			// old chain back first.
			i.log.Info("chain moves", "reason", why, "previous", st.Written, "primary", p.Path)
			if err := i.release(st); err != nil {
				return Unchanged, nil, err
			}
			st = nil
			if p, err = i.findPrimary(); err != nil || p == nil {
				return NoPrimary, nil, err
			}
			if layout, err = i.layoutFor(p, nil); err != nil {
				return Unchanged, nil, err
			}
		}
	}
	if layout == LayoutPluginDir {
		out, err := i.reconcilePluginDir(p, st)
		return out, p, err
	}
	data, mode, err := readFile(p.Path)
	if err != nil {
		return Unchanged, nil, err
	}
	if st != nil && sha256Hex(data) == st.WrittenSHA256 {
		return Unchanged, p, nil
	}
	switch has := chainHas(p.List); {
	case has && st != nil:
		// Rewritten by someone who kept aether-cni: theirs now;
		// uninstall removes only the aether-cni entry.
		return Unchanged, p, nil
	case has:
		return Foreign, p, nil
	}
	if err := i.chain(p.Path, data, mode, st); err != nil {
		return Unchanged, nil, err
	}
	if st != nil {
		return Repaired, p, nil
	}
	return Chained, p, nil
}

// stale says why the chain recorded in st is not the one to keep for
// primary p (laid out as layout), or "" when it is.
func stale(st *State, p *Primary, layout string) string {
	switch {
	case st.Layout == LayoutPluginDir && st.Original != p.Path, st.Layout == "" && st.Written != p.Path:
		return "primary changed"
	case st.Layout != layout:
		if layout == LayoutPluginDir {
			return "the network's plugin directory holds plugins, loaded after the inline ones"
		}
		return "the network's plugin directory holds no other plugin"
	case st.WrittenTarget != linkTarget(st.Written):
		return "symlink retargeted"
	}
	return ""
}

// linkTarget is the file a symlink resolves to, "" for anything else.
func linkTarget(path string) string {
	if !isSymlink(path) {
		return ""
	}
	t, err := filepath.EvalSymlinks(path)
	if err != nil {
		return ""
	}
	return t
}

func (i *Installer) findPrimary() (*Primary, error) {
	primary, skipped, err := FindPrimary(i.cfg.ConfDir)
	for _, s := range skipped {
		i.log.Warn("conf file skipped: the runtime would not load it", "path", s.Path, "error", s.Err.Error())
	}
	return primary, err
}

func readFile(path string) ([]byte, fs.FileMode, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, 0, fmt.Errorf("failed to stat primary %q: %w", path, err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, 0, fmt.Errorf("failed to read primary %q: %w", path, err)
	}
	return data, st.Mode().Perm(), nil
}

// chain writes primary (content data, the owner's bytes) with aether-cni
// as the last plugin. The state is saved before the conf dir changes, so a
// crash in between leaves nothing the next Reconcile cannot sort out.
func (i *Installer) chain(primary string, data []byte, mode fs.FileMode, prev *State) error {
	target := ListPath(primary)
	list := data
	st := &State{Original: primary, OriginalBytes: data, OriginalMode: mode, Written: target}
	if target != primary {
		if _, err := os.Lstat(target); err == nil && (prev == nil || prev.Written != target) {
			return fmt.Errorf("failed to chain single-plugin primary %q: converting it needs %q, which exists and was not written by the installer; remove one of them", primary, target)
		}
		var err error
		if list, err = ConfToList(data); err != nil {
			return fmt.Errorf("failed to convert primary %q to a conflist: %w", primary, err)
		}
		if isSymlink(primary) {
			// The conversion removes the link; uninstall puts it back.
			if st.OriginalLink, err = os.Readlink(primary); err != nil {
				return fmt.Errorf("failed to read symlink %q: %w", primary, err)
			}
		}
	} else {
		// A symlinked conflist stays a link: its target is written.
		st.WrittenTarget = linkTarget(primary)
	}
	out, err := Insert(list, i.cfg.Entry)
	if err != nil {
		return fmt.Errorf("failed to insert aether-cni into primary %q: %w", primary, err)
	}
	st.WrittenSHA256 = sha256Hex(out)
	if err := saveState(i.cfg.StateFile, st); err != nil {
		return err
	}
	if err := WriteFileAtomic(st.file(), out, mode); err != nil {
		return fmt.Errorf("failed to write primary %q: %w", st.file(), err)
	}
	if target != primary {
		if err := os.Remove(primary); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("failed to remove converted primary %q: %w", primary, err)
		}
	}
	i.log.Info("aether-cni chained", "primary", primary, "path", st.file())
	return nil
}

// release undoes the chain recorded in st and forgets it: the original
// bytes come back when the file is still exactly what the installer wrote;
// otherwise only the aether-cni entry is removed and the other writer's
// changes stay. It never overwrites a file the installer did not write.
func (i *Installer) release(st *State) error {
	if st.Layout == LayoutPluginDir {
		if err := i.releasePluginDir(st); err != nil {
			return err
		}
		return removeState(i.cfg.StateFile)
	}
	file := st.file()
	cur, err := os.ReadFile(file)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		i.log.Info("chained primary is gone: nothing to restore", "path", file)
	case err != nil:
		return fmt.Errorf("failed to read chained primary %q: %w", file, err)
	case sha256Hex(cur) == st.WrittenSHA256:
		if err := i.restore(st); err != nil {
			return err
		}
	default:
		out, removed, err := Remove(cur)
		if err != nil {
			return fmt.Errorf("failed to remove aether-cni from %q: %w", file, err)
		}
		if removed {
			mode := st.OriginalMode
			if fi, err := os.Stat(file); err == nil {
				mode = fi.Mode().Perm()
			}
			if err := WriteFileAtomic(file, out, mode); err != nil {
				return fmt.Errorf("failed to write primary %q: %w", file, err)
			}
		}
		i.log.Info("primary rewritten by another writer: removed only aether-cni", "path", file, "removed", removed)
	}
	return removeState(i.cfg.StateFile)
}

func (i *Installer) restore(st *State) error {
	if !st.Converted() {
		if err := WriteFileAtomic(st.file(), st.OriginalBytes, st.OriginalMode); err != nil {
			return fmt.Errorf("failed to restore primary %q: %w", st.file(), err)
		}
		i.log.Info("primary restored", "path", st.Written, "file", st.file())
		return nil
	}
	// Converted: the single-plugin original (or its symlink) comes back
	// first (it sorts before our conflist), then our conflist goes. When
	// the owner has already written a new original, it is kept.
	if _, err := os.Lstat(st.Original); errors.Is(err, fs.ErrNotExist) {
		if st.OriginalLink != "" {
			if err := SymlinkAtomic(st.OriginalLink, st.Original); err != nil {
				return fmt.Errorf("failed to restore primary %q: %w", st.Original, err)
			}
		} else if err := WriteFileAtomic(st.Original, st.OriginalBytes, st.OriginalMode); err != nil {
			return fmt.Errorf("failed to restore primary %q: %w", st.Original, err)
		}
	}
	if err := os.Remove(st.Written); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("failed to remove converted conflist %q: %w", st.Written, err)
	}
	i.log.Info("primary restored", "path", st.Original, "removed", st.Written)
	return nil
}

// UninstallConfig removes the chain recorded in the state file, if any.
func (i *Installer) UninstallConfig() error {
	st, err := loadState(i.cfg.StateFile)
	if err != nil || st == nil {
		return err
	}
	return i.release(st)
}

// Uninstall removes everything the installer added: the chain first (so
// the runtime stops calling aether-cni), then the binaries.
func (i *Installer) Uninstall() error {
	return errors.Join(i.UninstallConfig(), i.RemoveBinaries())
}
