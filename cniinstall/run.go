package cniinstall

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// minBackoff is the first wait once a fight is detected.
const minBackoff = 100 * time.Millisecond

// Run installs the binaries and the chain, then watches the conf dir and
// repairs the chain until ctx is done, and finally uninstalls, unless
// UninstallOnExit keeps them (keepOnExit; asked only when ctx ends, never
// after a failure). A failure of the first install is returned (after
// undoing what was done); later reconcile failures are logged and retried
// with backoff.
func (i *Installer) Run(ctx context.Context) (err error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("failed to create conf dir watcher: %w", err)
	}
	defer func() { _ = w.Close() }()
	// Watch before the first reconcile so no rewrite in between is missed.
	if err := w.Add(i.cfg.ConfDir); err != nil {
		return fmt.Errorf("failed to watch conf dir %q: %w", i.cfg.ConfDir, err)
	}
	i.syncWatches(w)
	keep := false
	defer func() {
		i.setReady(false)
		if keep {
			i.log.Info("stopped; chain, binaries and state file left for the next installer", "state_file", i.cfg.StateFile)
			return
		}
		if uerr := i.Uninstall(); uerr != nil {
			err = errors.Join(err, fmt.Errorf("failed to uninstall: %w", uerr))
			return
		}
		i.log.Info("uninstalled")
	}()
	if err := i.InstallBinaries(); err != nil {
		return err
	}
	out, err := i.Reconcile()
	if err != nil {
		return err
	}
	i.logOutcome(out)
	if err := i.watch(ctx, w); err != nil {
		return err
	}
	keep = i.keepOnExit()
	return nil
}

// watch is the repair loop: debounced conf dir events, a periodic resync,
// and exponential backoff while another writer keeps undoing the chain.
func (i *Installer) watch(ctx context.Context, w *fsnotify.Watcher) error {
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	resync := time.NewTicker(i.cfg.Resync)
	defer resync.Stop()
	var (
		lastRepair time.Time
		backoff    time.Duration // between repairs while another writer fights
		errBackoff time.Duration // between failed reconciles
		notBefore  time.Time
	)
	// One pending timer at a time, armed by the first event of a burst
	// and not pushed back by later ones: a writer that never pauses must
	// not starve the repair.
	pending := false
	arm := func(d time.Duration) {
		if pending {
			return
		}
		if wait := time.Until(notBefore); wait > d {
			d = wait
		}
		debounce.Reset(d)
		pending = true
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("conf dir watcher closed")
			}
			if ev.Op == fsnotify.Chmod || isTempName(filepath.Base(ev.Name)) {
				continue // our temp files, metadata only
			}
			arm(i.cfg.Debounce)
		case werr, ok := <-w.Errors:
			if !ok {
				return errors.New("conf dir watcher closed")
			}
			i.log.Warn("conf dir watcher error; resyncing", "error", werr.Error())
			arm(i.cfg.Debounce)
		case <-resync.C:
			arm(0)
		case <-debounce.C:
			pending = false
			// Watches first, so a change after this reconcile read the
			// directories is an event.
			i.syncWatches(w)
			out, err := i.Reconcile()
			now := time.Now()
			if i.syncWatches(w) {
				arm(0) // a directory that appeared meanwhile: read it once more
			}
			if err != nil {
				// Not known to be chained: the probe waits (the safe side).
				i.setReady(false)
				errBackoff = nextBackoff(errBackoff, i.cfg.MaxBackoff)
				i.log.Error("failed to reconcile the chain; retrying", "error", err.Error(), "backoff", errBackoff.String())
				arm(errBackoff)
				continue
			}
			errBackoff = 0
			if out == Repaired {
				// Our own write echoes back as Unchanged, so only the
				// time between repairs tells a fight from a one-off.
				if now.Sub(lastRepair) < i.cfg.FightWindow {
					backoff = nextBackoff(backoff, i.cfg.MaxBackoff)
					i.log.Warn("another writer keeps removing aether-cni; backing off", "backoff", backoff.String())
				} else {
					backoff = 0
				}
				lastRepair = now
				notBefore = now.Add(backoff)
			}
			i.logOutcome(out)
		}
	}
}

// syncWatches watches, besides the conf dir, every directory whose change
// can change the runtime's chain: each sub-directory of the conf dir (a
// network's plugin directory, CNI spec 1.1, is one; the others cost a
// cheap reconcile per change) and the directory of each symlinked conf
// file's target. It reports whether it added a watch.
func (i *Installer) syncWatches(w *fsnotify.Watcher) bool {
	want := map[string]bool{}
	ents, err := os.ReadDir(i.cfg.ConfDir)
	if err != nil {
		i.log.Warn("failed to list conf dir for its watches", "path", i.cfg.ConfDir, "error", err.Error())
		return false
	}
	for _, e := range ents {
		path := filepath.Join(i.cfg.ConfDir, e.Name())
		fi, err := os.Stat(path) // through symlinks
		switch {
		case err != nil:
		case fi.IsDir():
			want[path] = true
		case e.Type()&fs.ModeSymlink != 0 && IsConfName(e.Name()):
			if t, err := filepath.EvalSymlinks(path); err == nil && filepath.Dir(t) != filepath.Clean(i.cfg.ConfDir) {
				want[filepath.Dir(t)] = true
			}
		}
	}
	have := map[string]bool{}
	for _, d := range w.WatchList() {
		have[d] = true
	}
	added := false
	for d := range want {
		if have[d] {
			continue
		}
		if err := w.Add(d); err != nil {
			i.log.Warn("failed to watch directory; the resync still covers it", "path", d, "error", err.Error())
			continue
		}
		added = true
	}
	for d := range have {
		if !want[d] && d != filepath.Clean(i.cfg.ConfDir) {
			_ = w.Remove(d) // gone already, or no longer relevant
		}
	}
	return added
}

func nextBackoff(cur, limit time.Duration) time.Duration {
	cur *= 2
	if cur < minBackoff {
		cur = minBackoff
	}
	return min(cur, limit)
}

func (i *Installer) logOutcome(out Outcome) {
	i.setReady(out != NoPrimary)
	switch out {
	case Unchanged:
		i.log.Debug("chain in place", "outcome", out.String())
	case NoPrimary:
		i.log.Info("no primary network configuration yet; waiting for one", "path", i.cfg.ConfDir, "outcome", out.String())
	case Foreign:
		i.log.Info("primary already chains aether-cni (not added by the installer); leaving it alone", "outcome", out.String())
	default:
		i.log.Info("chain reconciled", "outcome", out.String())
	}
}

// setReady creates or removes ReadyFile (when set). A failure is logged:
// the startup probe then keeps waiting, which is the safe side.
func (i *Installer) setReady(ready bool) {
	if i.cfg.ReadyFile == "" {
		return
	}
	if !ready {
		if err := os.Remove(i.cfg.ReadyFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
			i.log.Warn("failed to remove ready file", "path", i.cfg.ReadyFile, "error", err.Error())
		}
		return
	}
	if _, err := os.Stat(i.cfg.ReadyFile); err == nil {
		return
	}
	if err := WriteFileAtomic(i.cfg.ReadyFile, []byte("chained\n"), 0o644); err != nil {
		i.log.Warn("failed to write ready file", "path", i.cfg.ReadyFile, "error", err.Error())
	}
}

// CheckReady is the startup probe (--check-ready): nil when path exists,
// an error saying what the installer still waits for otherwise.
func CheckReady(path string) error {
	if path == "" {
		return errors.New("--check-ready needs --ready-file")
	}
	if _, err := os.Stat(path); err != nil {
		return fmt.Errorf("not ready: aether-cni is not chained yet (no %s): %w", path, err)
	}
	return nil
}
