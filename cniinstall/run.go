package cniinstall

import (
	"context"
	"errors"
	"fmt"
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
	keep := false
	defer func() {
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
			if ev.Op == fsnotify.Chmod || !IsConfName(filepath.Base(ev.Name)) {
				continue // temp files, unrelated files, metadata only
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
			out, err := i.Reconcile()
			now := time.Now()
			if err != nil {
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

func nextBackoff(cur, limit time.Duration) time.Duration {
	cur *= 2
	if cur < minBackoff {
		cur = minBackoff
	}
	return min(cur, limit)
}

func (i *Installer) logOutcome(out Outcome) {
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
