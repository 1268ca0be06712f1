package cniinstall

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// fakeOwner answers DaemonSetStays and counts the questions.
type fakeOwner struct {
	stays bool
	err   error
	// hang waits for the deadline instead of answering.
	hang  bool
	asked atomic.Int32
}

func (f *fakeOwner) DaemonSetStays(ctx context.Context) (bool, string, error) {
	f.asked.Add(1)
	if f.hang {
		<-ctx.Done()
		return false, "", ctx.Err()
	}
	return f.stays, "fake", f.err
}

// TestUninstallOnExit: on stop, each mode and each answer of the owner
// either keeps the chain, the binaries and the state file (for the next
// installer) or restores the primary byte for byte and removes them.
func TestUninstallOnExit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		mode     UninstallMode
		owner    *fakeOwner // nil: not running in a pod
		wantKeep bool
		wantAsk  int32
	}{
		{name: "auto, DaemonSet stays (rolling update)", mode: UninstallAuto, owner: &fakeOwner{stays: true}, wantKeep: true, wantAsk: 1},
		{name: "auto, DaemonSet gone or being deleted", mode: UninstallAuto, owner: &fakeOwner{}, wantAsk: 1},
		{name: "auto, API error: fail closed", mode: UninstallAuto, owner: &fakeOwner{err: errors.New("connection refused")}, wantKeep: true, wantAsk: 1},
		{name: "auto, API hangs past the deadline: fail closed", mode: UninstallAuto, owner: &fakeOwner{hang: true}, wantKeep: true, wantAsk: 1},
		{name: "auto outside a pod", mode: UninstallAuto},
		{name: "zero value is auto", owner: &fakeOwner{stays: true}, wantKeep: true, wantAsk: 1},
		{name: "always", mode: UninstallAlways, owner: &fakeOwner{stays: true}},
		{name: "never", mode: UninstallNever, owner: &fakeOwner{}, wantKeep: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			orig := primaries(t)["10-calico.conflist"]
			e.write(t, "10-calico.conflist", orig)
			stop := start(t, e, func(c *Config) {
				c.UninstallOnExit = tc.mode
				c.OwnerTimeout = 50 * time.Millisecond
				if tc.owner != nil {
					c.Owner = tc.owner
				}
			})
			path := filepath.Join(e.conf, "10-calico.conflist")
			waitChained(t, path)
			chained := e.read(t, "10-calico.conflist")
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if tc.owner != nil && tc.owner.asked.Load() != tc.wantAsk {
				t.Errorf("owner asked %d times, want %d", tc.owner.asked.Load(), tc.wantAsk)
			}
			if !tc.wantKeep {
				if got := e.read(t, "10-calico.conflist"); string(got) != string(orig) {
					t.Fatalf("after uninstall:\nwant %q\ngot  %q", orig, got)
				}
				for _, p := range []string{filepath.Join(e.bin, "aether-cni"), filepath.Join(e.bin, "eni-vlan"), e.state} {
					mustNotExist(t, p)
				}
				return
			}
			if got := e.read(t, "10-calico.conflist"); string(got) != string(chained) {
				t.Fatalf("chain not kept:\nwant %q\ngot  %q", chained, got)
			}
			for _, p := range []string{filepath.Join(e.bin, "aether-cni"), filepath.Join(e.bin, "eni-vlan"), e.state} {
				if _, err := os.Stat(p); err != nil {
					t.Fatalf("%s not kept: %v", p, err)
				}
			}
			// The next installer adopts the state: no write, and its
			// uninstall restores the owner's bytes.
			stop = start(t, e, func(c *Config) { c.UninstallOnExit = UninstallAlways })
			waitChained(t, path)
			if err := stop(); err != nil {
				t.Fatalf("next installer: %v", err)
			}
			if got := e.read(t, "10-calico.conflist"); string(got) != string(orig) {
				t.Fatalf("after the next installer's uninstall:\nwant %q\ngot  %q", orig, got)
			}
			mustNotExist(t, e.state)
		})
	}
}

// TestUninstallOnExitNotAfterFailure: a failed first install is undone
// whatever the mode; the owner is not asked.
func TestUninstallOnExitNotAfterFailure(t *testing.T) {
	e := newEnv(t)
	e.write(t, "10-calico.conflist", primaries(t)["10-calico.conflist"])
	if err := os.Remove(filepath.Join(e.src, "eni-vlan")); err != nil {
		t.Fatal(err)
	}
	owner := &fakeOwner{stays: true}
	i, err := New(Config{
		BinDir: e.bin, ConfDir: e.conf, SourceDir: e.src, StateFile: e.state,
		Binaries: []string{"aether-cni", "eni-vlan"}, Entry: []byte(testEntry),
		UninstallOnExit: UninstallNever, Owner: owner,
	}, e.installer(t).log)
	if err != nil {
		t.Fatal(err)
	}
	if err := i.Run(context.Background()); err == nil {
		t.Fatal("Run with a missing source binary succeeded")
	}
	mustNotExist(t, filepath.Join(e.bin, "aether-cni"))
	if owner.asked.Load() != 0 {
		t.Fatalf("owner asked %d times after a failed install", owner.asked.Load())
	}
}

func TestParseUninstallMode(t *testing.T) {
	for _, s := range []string{"auto", "always", "never"} {
		if m, err := ParseUninstallMode(s); err != nil || string(m) != s {
			t.Errorf("ParseUninstallMode(%q) = %q, %v", s, m, err)
		}
	}
	for _, s := range []string{"", "Auto", "sometimes"} {
		if _, err := ParseUninstallMode(s); err == nil {
			t.Errorf("ParseUninstallMode(%q) succeeded", s)
		}
	}
	e := newEnv(t)
	_, err := New(Config{
		BinDir: e.bin, ConfDir: e.conf, SourceDir: e.src, StateFile: e.state, Entry: []byte(testEntry),
		UninstallOnExit: "sometimes",
	}, nil)
	if err == nil || err.Error() != `invalid --uninstall-on-exit "sometimes": must be auto, always or never` {
		t.Errorf("New with an invalid uninstall mode: %v", err)
	}
}
