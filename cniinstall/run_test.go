package cniinstall

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync/atomic"
	"testing"
	"time"
)

// waitDeadline is generous: it only bounds a broken test, it is no speed
// goal (the benchmark measures speed).
const waitDeadline = 10 * time.Second

// start runs the installer until the test ends (or stop is called) and
// returns stop, which cancels Run and returns its error.
func start(t testing.TB, e env, mutate func(*Config)) (stop func() error) {
	t.Helper()
	return startWithLog(t, e, mutate, func(h slog.Handler) slog.Handler { return h })
}

func startWithLog(t testing.TB, e env, mutate func(*Config), wrap func(slog.Handler) slog.Handler) (stop func() error) {
	t.Helper()
	cfg := Config{
		BinDir: e.bin, ConfDir: e.conf, SourceDir: e.src, StateFile: e.state,
		Binaries: []string{"aether-cni", "eni-vlan"},
		Entry:    []byte(testEntry),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	i, err := New(cfg, slog.New(wrap(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- i.Run(ctx) }()
	var result error
	stopped := false
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			result = <-done
		}
		return result
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// waitChained waits until path chains aether-cni and returns how long it
// took.
func waitChained(t testing.TB, path string) time.Duration {
	t.Helper()
	begin := time.Now()
	for {
		if data, err := os.ReadFile(path); err == nil {
			if has, err := HasPlugin(data); err == nil && has {
				return time.Since(begin)
			}
		}
		if time.Since(begin) > waitDeadline {
			data, _ := os.ReadFile(path)
			t.Fatalf("%s does not chain aether-cni after %v:\n%s", path, waitDeadline, data)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestWatcherRepairs: with the real fsnotify on a temp dir, another writer
// rewrites the primary without aether-cni and the chain comes back without
// a restart; SIGTERM (cancel) then restores the owner's bytes.
func TestWatcherRepairs(t *testing.T) {
	for _, tc := range []struct {
		name string
		// atomic: the other writer replaces the file by rename (as
		// installers do) rather than truncating and writing in place.
		atomic bool
	}{
		{"rewrite in place", false},
		{"replace by rename", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			orig := primaries(t)["10-calico.conflist"]
			e.write(t, "10-calico.conflist", orig)
			stop := start(t, e, nil)
			path := filepath.Join(e.conf, "10-calico.conflist")
			waitChained(t, path)
			for round := range 3 {
				if tc.atomic {
					if err := WriteFileAtomic(path, orig, 0o644); err != nil {
						t.Fatal(err)
					}
				} else {
					e.write(t, "10-calico.conflist", orig)
				}
				t.Logf("round %d: chain back %v after the rewrite", round, waitChained(t, path))
			}
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if got := e.read(t, "10-calico.conflist"); string(got) != string(orig) {
				t.Fatalf("after uninstall:\nwant %q\ngot  %q", orig, got)
			}
			for _, b := range []string{"aether-cni", "eni-vlan"} {
				mustNotExist(t, filepath.Join(e.bin, b))
			}
			mustNotExist(t, e.state)
		})
	}
}

// TestWatcherPrimaryChanges: the installer waits for a primary, chains it,
// and moves the chain when a lexically-first primary appears.
func TestWatcherPrimaryChanges(t *testing.T) {
	e := newEnv(t)
	stop := start(t, e, nil)
	bridge := primaries(t)["10-bridge.conflist"]
	cilium := primaries(t)["05-cilium.conflist"]
	// The CNI provider's agent starts after the installer.
	e.write(t, "10-bridge.conflist", bridge)
	t.Logf("first primary chained %v after it appeared", waitChained(t, filepath.Join(e.conf, "10-bridge.conflist")))
	e.write(t, "05-cilium.conflist", cilium)
	t.Logf("new primary chained %v after it appeared", waitChained(t, filepath.Join(e.conf, "05-cilium.conflist")))
	if got := e.read(t, "10-bridge.conflist"); string(got) != string(bridge) {
		t.Fatalf("previous primary not restored:\n%s", got)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got := e.read(t, "05-cilium.conflist"); string(got) != string(cilium) {
		t.Fatalf("primary not restored:\n%s", got)
	}
	names := e.files(t)
	sort.Strings(names)
	if !slices.Equal(names, []string{"05-cilium.conflist -rw-r--r--", "10-bridge.conflist -rw-r--r--"}) {
		t.Fatalf("conf dir holds %v", names)
	}
}

// TestWatcherFight: another writer that keeps removing aether-cni does not
// make the installer spin: it backs off, and once the writer stops the
// chain is back.
func TestWatcherFight(t *testing.T) {
	e := newEnv(t)
	orig := primaries(t)["10-flannel.conflist"]
	e.write(t, "10-flannel.conflist", orig)
	path := filepath.Join(e.conf, "10-flannel.conflist")
	var repairs atomic.Int64
	startWithLog(t, e, func(c *Config) { c.MaxBackoff = 400 * time.Millisecond }, func(h slog.Handler) slog.Handler {
		return repairCounter{h, &repairs}
	})
	waitChained(t, path)
	const rewrites = 20
	for range rewrites {
		e.write(t, "10-flannel.conflist", orig)
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("chain back %v after the fighting writer stopped", waitChained(t, path))
	if n := repairs.Load(); n >= rewrites {
		t.Fatalf("%d repairs for %d rewrites: the installer did not back off", n, rewrites)
	} else {
		t.Logf("%d repairs for %d rewrites", n, rewrites)
	}
}

// repairCounter counts the installer's "repaired" outcomes from its logs.
type repairCounter struct {
	slog.Handler
	n *atomic.Int64
}

func (h repairCounter) Handle(ctx context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "outcome" && a.Value.String() == Repaired.String() {
			h.n.Add(1)
		}
		return true
	})
	return h.Handler.Handle(ctx, r)
}

func TestNextBackoff(t *testing.T) {
	var got []time.Duration
	b := time.Duration(0)
	for range 6 {
		b = nextBackoff(b, time.Second)
		got = append(got, b)
	}
	want := []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond, time.Second, time.Second}
	if !slices.Equal(got, want) {
		t.Fatalf("backoff sequence %v, want %v", got, want)
	}
}

// BenchmarkInstallerRepair measures rewrite → repaired latency through the
// real fsnotify watcher: another writer rewrites the primary without
// aether-cni and the benchmark waits until the chain is back. The default
// debounce (DefaultDebounce) is part of the latency.
func BenchmarkInstallerRepair(b *testing.B) {
	e := newEnv(b)
	orig := primaries(b)["10-bridge.conflist"]
	e.write(b, "10-bridge.conflist", orig)
	path := filepath.Join(e.conf, "10-bridge.conflist")
	// Every iteration is a rewrite; without a tiny fight window the
	// installer would (rightly) back off and the benchmark would measure
	// the backoff.
	startWithLog(b, e, func(c *Config) { c.FightWindow = time.Nanosecond },
		func(slog.Handler) slog.Handler { return slog.DiscardHandler })
	waitChained(b, path)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for b.Loop() {
		e.write(b, "10-bridge.conflist", orig)
		lat = append(lat, waitChained(b, path))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[(len(lat)*99)/100].Nanoseconds()), "p99-ns")
}
