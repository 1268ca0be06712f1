package cniinstall

import (
	"context"
	"fmt"
	"time"
)

// UninstallMode says what the installer does with the chain and the
// binaries when it is told to stop (SIGTERM).
type UninstallMode string

// Uninstall modes (--uninstall-on-exit).
const (
	// UninstallAuto uninstalls unless the installer's DaemonSet stays (a
	// rolling update): see Installer.keepOnExit. The zero value.
	UninstallAuto UninstallMode = "auto"
	// UninstallAlways uninstalls on every stop (the behaviour before auto).
	UninstallAlways UninstallMode = "always"
	// UninstallNever leaves the chain, the binaries and the state file.
	UninstallNever UninstallMode = "never"
)

// DefaultOwnerTimeout bounds the API calls of the auto decision; the
// kubelet's grace period (30 s by default) must leave room for it and for
// the uninstall that may follow.
const DefaultOwnerTimeout = 5 * time.Second

// ParseUninstallMode parses --uninstall-on-exit.
func ParseUninstallMode(s string) (UninstallMode, error) {
	switch m := UninstallMode(s); m {
	case UninstallAuto, UninstallAlways, UninstallNever:
		return m, nil
	}
	return "", fmt.Errorf("invalid --uninstall-on-exit %q: must be auto, always or never", s)
}

// OwnerChecker is the one question the installer asks Kubernetes (a small
// REST client, KubeOwner; a fake in unit tests).
type OwnerChecker interface {
	// DaemonSetStays reports whether the DaemonSet that controls the
	// installer's pod still exists and is not being deleted, with a
	// sentence for the log. An error means the answer is unknown.
	DaemonSetStays(ctx context.Context) (stays bool, why string, err error)
}

// keepOnExit decides, once the installer is told to stop, whether to leave
// the chain, the binaries and the state file for the next installer.
//
// auto asks the Owner within OwnerTimeout: the DaemonSet stays → keep (a
// rolling update: the next installer pod adopts the state file, and no pod
// created in between starts uncaptured); it is gone or being deleted →
// uninstall; the API server refuses the service account (401/403: `helm
// uninstall` deletes the ServiceAccount and Role with the DaemonSet, before
// the pods stop) → uninstall. Without an Owner (not running in a pod) there
// is no DaemonSet to wait for: uninstall.
//
// No answer (API down, deadline, another error) → keep. Keeping fails closed
// and visibly: if the DaemonSet really was deleted, aether-cni stays
// chained with no agent and answers code 11 ("try again later") to every
// ADD on this node until the chain is removed (the next installer with
// --uninstall-on-exit=always, or by hand); kubelet keeps retrying and the
// events name aether-cni. Uninstalling on no answer would fail open and
// silently: during a rolling update, pods created before the new installer
// chains again would run without capture and nothing would say so.
func (i *Installer) keepOnExit() bool {
	switch i.cfg.UninstallOnExit {
	case UninstallNever:
		i.log.Info("leaving the chain and binaries in place", "uninstall_on_exit", string(UninstallNever))
		return true
	case UninstallAlways:
		return false
	}
	if i.cfg.Owner == nil {
		i.log.Info("not running in a Kubernetes pod: no DaemonSet to wait for; uninstalling", "uninstall_on_exit", string(UninstallAuto))
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), i.cfg.OwnerTimeout)
	defer cancel()
	stays, why, err := i.cfg.Owner.DaemonSetStays(ctx)
	switch {
	case err != nil:
		i.log.Warn("could not tell whether the DaemonSet stays; leaving the chain and binaries in place (fail closed)",
			"uninstall_on_exit", string(UninstallAuto), "error", err.Error())
		return true
	case stays:
		i.log.Info("DaemonSet stays (rolling update); leaving the chain and binaries for the next installer",
			"uninstall_on_exit", string(UninstallAuto), "reason", why)
		return true
	}
	i.log.Info("DaemonSet gone or being deleted; uninstalling", "uninstall_on_exit", string(UninstallAuto), "reason", why)
	return false
}
