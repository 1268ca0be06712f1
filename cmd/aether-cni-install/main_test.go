package main

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"aether.io/node/cniinstall"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) {
	code := m.Run()
	harness.CleanupOwn()
	os.Exit(code)
}

// deadline bounds a broken test; it is no speed goal.
const deadline = 10 * time.Second

type node struct{ conf, bin, src, state string }

func newNode(t *testing.T) node {
	t.Helper()
	root := t.TempDir()
	n := node{
		conf:  filepath.Join(root, "host/etc/cni/net.d"),
		bin:   filepath.Join(root, "host/opt/cni/bin"),
		src:   filepath.Join(root, "image/bin"),
		state: filepath.Join(root, "host/var/lib/aether/cni-install/state.json"),
	}
	for _, d := range []string{n.conf, n.bin, n.src} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range []string{"aether-cni", "eni-vlan"} {
		if err := os.WriteFile(filepath.Join(n.src, b), []byte("#!/bin/sh\n# "+b+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

func (n node) flags(extra ...string) []string {
	return append([]string{
		"--cni-conf-dir=" + n.conf, "--cni-bin-dir=" + n.bin, "--source-dir=" + n.src,
		"--state-file=" + n.state, "--log-level=debug",
	}, extra...)
}

// run starts the real binary and returns it with its stderr.
func run(t *testing.T, args ...string) (*exec.Cmd, *lockedBuffer) {
	t.Helper()
	return runEnv(t, nil, args...)
}

// runEnv is run with extra environment variables.
func runEnv(t *testing.T, env []string, args ...string) (*exec.Cmd, *lockedBuffer) {
	t.Helper()
	bin := filepath.Join(harness.BuildOwn(t, "aether-cni-install"), "aether-cni-install")
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill() // only the process this test started
			_ = cmd.Wait()
		}
	})
	return cmd, stderr
}

// lockedBuffer is the process's stderr, readable while it runs.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func wait(t *testing.T, cmd *exec.Cmd, stderr *lockedBuffer) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		t.Logf("aether-cni-install stderr:\n%s", stderr.String())
		return cmd.ProcessState.ExitCode()
	case <-time.After(deadline):
		t.Fatalf("aether-cni-install did not exit within %v", deadline)
		return -1
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	begin := time.Now()
	for !cond() {
		if time.Since(begin) > deadline {
			t.Fatalf("%s: not within %v", what, deadline)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("%s after %v", what, time.Since(begin))
}

// chained: the runtime's primary is the conflist the installer writes for
// path (a converted single-plugin file is gone) and it chains aether-cni.
func chained(path string) func() bool {
	written := cniinstall.ListPath(path)
	return func() bool {
		if written != path {
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				return false
			}
		}
		data, err := os.ReadFile(written)
		if err != nil {
			return false
		}
		has, err := cniinstall.HasPlugin(data)
		return err == nil && has
	}
}

// TestBinary drives the real binary: install, another writer's rewrite
// repaired, SIGTERM, then the primary is back byte for byte and the
// binaries are gone.
func TestBinary(t *testing.T) {
	for _, primary := range []string{"10-calico.conflist", "10-bridge.conf"} {
		t.Run(primary, func(t *testing.T) {
			orig, err := os.ReadFile(filepath.Join("../../cniinstall/testdata/primaries", primary))
			if err != nil {
				t.Fatal(err)
			}
			n := newNode(t)
			path := filepath.Join(n.conf, primary)
			if err := os.WriteFile(path, orig, 0o644); err != nil {
				t.Fatal(err)
			}
			cmd, stderr := run(t, n.flags("--install-eni-vlan")...)
			waitFor(t, "chained", chained(path))
			for _, b := range []string{"aether-cni", "eni-vlan"} {
				fi, err := os.Stat(filepath.Join(n.bin, b))
				if err != nil || fi.Mode().Perm() != cniinstall.BinaryMode {
					t.Fatalf("%s in bin dir: %v (err %v), want mode %v", b, fi, err, cniinstall.BinaryMode)
				}
			}
			// The primary's owner writes its file again, without aether-cni.
			if err := os.WriteFile(path, orig, 0o644); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "repaired", chained(path))
			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if code := wait(t, cmd, stderr); code != 0 {
				t.Fatalf("exit code %d after SIGTERM, want 0", code)
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, orig) {
				t.Fatalf("primary after uninstall:\nwant %q\ngot  %q", orig, got)
			}
			ents, err := os.ReadDir(n.conf)
			if err != nil {
				t.Fatal(err)
			}
			if len(ents) != 1 {
				t.Fatalf("conf dir holds %d files after uninstall, want only %s", len(ents), primary)
			}
			for _, p := range []string{filepath.Join(n.bin, "aether-cni"), filepath.Join(n.bin, "eni-vlan"), n.state} {
				if _, err := os.Lstat(p); !os.IsNotExist(err) {
					t.Fatalf("%s still exists after uninstall (err %v)", p, err)
				}
			}
		})
	}
}

func TestBinaryErrors(t *testing.T) {
	n := newNode(t)
	badEntry := filepath.Join(t.TempDir(), "entry.json")
	if err := os.WriteFile(badEntry, []byte(`{"type":"bridge"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown flag", []string{"--nope"}, 2, "flag provided but not defined: -nope"},
		{"stray argument", n.flags("install"), 2, `unexpected arguments "install"`},
		{"bad log level", n.flags("--log-level=loud"), 2, `invalid log level "loud": must be debug, info, warn or error`},
		{"plugin config of another type", n.flags("--plugin-config=" + badEntry), 2, `"type" must be "aether-cni"`},
		{"relative agent socket", n.flags("--agent-socket=cni.sock"), 2, `invalid agent_socket "cni.sock": must be an absolute path`},
		{"state file in conf dir", n.flags("--state-file=" + filepath.Join(n.conf, "state.json")), 2, "must be outside the conf dir"},
		{"bad uninstall mode", n.flags("--uninstall-on-exit=sometimes"), 2, `invalid --uninstall-on-exit "sometimes": must be auto, always or never`},
		{"missing conf dir", n.flags("--cni-conf-dir=" + filepath.Join(n.conf, "missing")), 1, "failed to watch conf dir"},
		{"missing source binary", n.flags("--source-dir=" + t.TempDir()), 1, "failed to read plugin binary"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd, stderr := run(t, tc.args...)
			if code := wait(t, cmd, stderr); code != tc.code {
				t.Fatalf("exit code %d, want %d", code, tc.code)
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("stderr does not say %q", tc.want)
			}
		})
	}
}

// calico writes the Calico-like primary into n's conf dir and returns its
// path and bytes.
func calico(t *testing.T, n node) (string, []byte) {
	t.Helper()
	orig, err := os.ReadFile("../../cniinstall/testdata/primaries/10-calico.conflist")
	if err != nil {
		t.Fatal(err)
	}
	primary := filepath.Join(n.conf, "10-calico.conflist")
	if err := os.WriteFile(primary, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	return primary, orig
}

// term sends SIGTERM and wants exit code 0.
func term(t *testing.T, cmd *exec.Cmd, stderr *lockedBuffer) {
	t.Helper()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := wait(t, cmd, stderr); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
}

// TestBinaryInPodWithoutPodName: in a pod (KUBERNETES_SERVICE_HOST set),
// auto needs POD_NAME and POD_NAMESPACE: exit 2 naming them; the other
// modes need neither.
func TestBinaryInPodWithoutPodName(t *testing.T) {
	n := newNode(t)
	env := []string{"KUBERNETES_SERVICE_HOST=10.96.0.1", "KUBERNETES_SERVICE_PORT=443", "POD_NAME=", "POD_NAMESPACE="}
	cmd, stderr := runEnv(t, env, n.flags()...)
	if code := wait(t, cmd, stderr); code != 2 {
		t.Fatalf("exit code %d, want 2", code)
	}
	if want := `POD_NAME="" and POD_NAMESPACE="" must both be set`; !strings.Contains(stderr.String(), want) {
		t.Fatalf("stderr does not say %q", want)
	}
	primary, orig := calico(t, n)
	cmd, stderr = runEnv(t, env, n.flags("--uninstall-on-exit=always")...)
	waitFor(t, "chained", chained(primary))
	term(t, cmd, stderr)
	if got, _ := os.ReadFile(primary); !bytes.Equal(got, orig) {
		t.Fatalf("primary after uninstall:\nwant %q\ngot  %q", orig, got)
	}
}

// TestBinaryKeepThenAdopt: --uninstall-on-exit=never leaves the chain, the
// binaries and the state file at SIGTERM (what auto does during a rolling
// update); the next installer adopts them without rewriting the primary and
// its uninstall restores the original byte for byte.
func TestBinaryKeepThenAdopt(t *testing.T) {
	n := newNode(t)
	primary, orig := calico(t, n)
	cmd, stderr := run(t, n.flags("--uninstall-on-exit=never")...)
	waitFor(t, "chained", chained(primary))
	term(t, cmd, stderr)
	kept, err := os.Stat(primary)
	if err != nil || !chained(primary)() {
		t.Fatalf("chain not kept after SIGTERM with never (err %v)", err)
	}
	for _, p := range []string{filepath.Join(n.bin, "aether-cni"), n.state} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s not kept: %v", p, err)
		}
	}
	cmd, stderr = run(t, n.flags("--uninstall-on-exit=always")...)
	waitFor(t, "state adopted", func() bool { return strings.Contains(stderr.String(), "chain in place") })
	if fi, err := os.Stat(primary); err != nil || !os.SameFile(fi, kept) || !fi.ModTime().Equal(kept.ModTime()) {
		t.Fatalf("the next installer rewrote the kept chain (err %v)", err)
	}
	term(t, cmd, stderr)
	if got, _ := os.ReadFile(primary); !bytes.Equal(got, orig) {
		t.Fatalf("primary after the next installer's uninstall:\nwant %q\ngot  %q", orig, got)
	}
	for _, p := range []string{filepath.Join(n.bin, "aether-cni"), n.state} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Fatalf("%s still exists after uninstall (err %v)", p, err)
		}
	}
}

// TestBinaryReadyProbe: --check-ready (the DaemonSet's startup probe) fails
// while no primary is chained, passes once aether-cni is chained, and fails
// again after the installer stopped.
func TestBinaryReadyProbe(t *testing.T) {
	n := newNode(t)
	ready := filepath.Join(t.TempDir(), "ready")
	bin := filepath.Join(harness.BuildOwn(t, "aether-cni-install"), "aether-cni-install")
	probe := func() (int, string) {
		out, err := exec.Command(bin, "--check-ready", "--ready-file", ready).CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0, string(out)
		case errors.As(err, &ee):
			return ee.ExitCode(), string(out)
		}
		t.Fatalf("probe: %v", err)
		return -1, ""
	}
	cmd, stderr := run(t, n.flags("--ready-file", ready, "--uninstall-on-exit", "always")...)
	// No primary yet: the installer runs and waits, the probe fails.
	waitFor(t, "installer waiting for a primary", func() bool { return strings.Contains(stderr.String(), "no primary network configuration yet") })
	if code, out := probe(); code != 1 || !strings.Contains(out, "not chained yet") {
		t.Fatalf("probe before a primary = %d %q, want 1 and the reason", code, out)
	}
	orig, err := os.ReadFile("../../cniinstall/testdata/primaries/10-calico.conflist")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(n.conf, "10-calico.conflist")
	if err := os.WriteFile(path, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "chained", chained(path))
	waitFor(t, "probe passes", func() bool { code, _ := probe(); return code == 0 })
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := wait(t, cmd, stderr); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	if code, _ := probe(); code != 1 {
		t.Fatalf("probe after the installer stopped = %d, want 1 (ready file removed)", code)
	}
	if code, out := func() (int, string) {
		out, err := exec.Command(bin, "--check-ready").CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), string(out)
		}
		return 0, string(out)
	}(); code != 1 || !strings.Contains(out, "--check-ready needs --ready-file") {
		t.Fatalf("--check-ready without --ready-file = %d %q, want 1 and the reason", code, out)
	}
}

// TestBinaryReadyProbeSpec11: on a node whose primary network is in the
// CNI spec 1.1 layout (a conflist without "plugins", its plugin objects in
// <conf dir>/<network name>/*.conf) followed by another conflist, the
// probe passes only once libcni's own loader gives the primary's chain
// with aether-cni last; the other conflist (which the runtime never uses)
// is untouched, and SIGTERM gives the layout back byte for byte. Before,
// the installer skipped the primary, chained the later file and the probe
// passed while pods ran uncaptured.
func TestBinaryReadyProbeSpec11(t *testing.T) {
	n := newNode(t)
	files := map[string]string{
		"10-net.conflist":     `{"cniVersion":"1.1.0","name":"net"}` + "\n",
		"net/10-bridge.conf":  `{"type":"bridge","bridge":"cni0"}` + "\n",
		"net/20-portmap.conf": `{"type":"portmap","capabilities":{"portMappings":true}}` + "\n",
		"20-other.conflist":   `{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"ptp"}]}` + "\n",
	}
	for name, c := range files {
		p := filepath.Join(n.conf, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ready := filepath.Join(t.TempDir(), "ready")
	bin := filepath.Join(harness.BuildOwn(t, "aether-cni-install"), "aether-cni-install")
	probe := func() int {
		err := exec.Command(bin, "--check-ready", "--ready-file", ready).Run()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	}
	cmd, stderr := run(t, n.flags("--ready-file", ready, "--uninstall-on-exit", "always")...)
	waitFor(t, "probe passes", func() bool { return probe() == 0 })
	l, err := libcni.LoadConfList(n.conf, "net")
	if err != nil {
		t.Fatal(err)
	}
	var chain []string
	for _, p := range l.Plugins {
		chain = append(chain, p.Network.Type)
	}
	if want := []string{"bridge", "portmap", "aether-cni"}; !slices.Equal(chain, want) {
		t.Fatalf("probe passed with the runtime's chain of network net %v; want %v", chain, want)
	}
	for _, name := range []string{"10-net.conflist", "20-other.conflist"} {
		if got, err := os.ReadFile(filepath.Join(n.conf, name)); err != nil || string(got) != files[name] {
			t.Fatalf("%s was changed (err %v):\n%s", name, err, got)
		}
	}
	term(t, cmd, stderr)
	var left []string
	if err := filepath.WalkDir(n.conf, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(n.conf, p)
		if got, err := os.ReadFile(p); err != nil || string(got) != files[rel] {
			t.Errorf("%s after uninstall (err %v):\n%s", rel, err, got)
		}
		left = append(left, rel)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(left) != len(files) {
		t.Fatalf("conf dir after uninstall holds %v; want only the owner's %d files", left, len(files))
	}
}
