package pin_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/meshcni/pin"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) {
	if ok, err := pin.RunHelperFromEnv(); ok {
		if err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	harness.Main(m)
}

func sameNS(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		return false
	}
	return sa.Ino == sb.Ino && sa.Dev == sb.Dev
}

func TestPinUnpinList(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pins")
	pod := harness.NewNS(t, "pin")
	id := harness.ContainerID()
	p, err := pin.Pin(dir, id, pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pin.Unpin(p) })
	if fi, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	} else if perm := fi.Mode().Perm(); perm != 0o700 {
		t.Fatalf("pin dir mode = %04o, want 0700", perm)
	}
	if !sameNS(t, pod.Path(), p) {
		t.Fatal("pin does not hold the pod's netns")
	}
	// A retried ADD pins again over the old pin.
	if p2, err := pin.Pin(dir, id, pod.Path()); err != nil || p2 != p {
		t.Fatalf("re-pin = %q, %v", p2, err)
	}
	// The pin keeps the namespace alive after the runtime's path is gone.
	other := harness.NewNS(t, "pin2")
	p3, err := pin.Pin(dir, "weird/id:with*chars", other.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pin.Unpin(p3) })
	if !strings.HasPrefix(filepath.Base(p3), "sha256-") {
		t.Fatalf("unsafe container ID used as file name: %s", p3)
	}
	names, err := pin.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	want := []string{id, filepath.Base(p3)}
	slices.Sort(want)
	if !slices.Equal(names, want) {
		t.Fatalf("List = %v, want %v", names, want)
	}
	for range 2 { // unpinning twice is fine
		if err := pin.Unpin(p); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("pin still there: %v", err)
	}
	if names, _ := pin.List(filepath.Join(dir, "absent")); names != nil {
		t.Fatalf("List of a missing dir = %v", names)
	}
}

// TestUnpinLater runs the detached helper (this test binary re-executed,
// see TestMain) and waits for it to remove the pin.
func TestUnpinLater(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pins")
	pod := harness.NewNS(t, "pinl")
	p, err := pin.Pin(dir, "late", pod.Path())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pin.Unpin(p) })
	if err := pin.UnpinLater(p, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("pin gone before its delay: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(p); os.IsNotExist(err) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("delayed unpin never happened")
}
