package harness

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// NetNSDir is where bind-mounted test namespaces live. It is not
// /var/run/netns, so tests never show up in (or collide with) `ip netns`.
const NetNSDir = "/run/aether-test/netns"

// NamePrefix starts the name of every namespace and link the harness makes.
const NamePrefix = "aet"

// NS is a network namespace made for one test.
type NS struct {
	ns.NetNS
	// Name is the namespace's unique name (also its file name under NetNSDir
	// when bind-mounted).
	Name string
}

// Do runs fn with the calling goroutine's thread inside the namespace, on a
// locked OS thread; the thread returns to its namespace afterwards.
func (n *NS) Do(fn func() error) error {
	return n.NetNS.Do(func(ns.NetNS) error { return fn() })
}

// MustDo is Do that fails the test on error.
func (n *NS) MustDo(tb testing.TB, fn func() error) {
	tb.Helper()
	if err := n.Do(fn); err != nil {
		tb.Fatalf("in netns %s: %v", n.Name, err)
	}
}

func randomName(prefix string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// NewNS creates a bind-mounted network namespace (a path usable as CNI_NETNS)
// with its loopback up, and removes it in t.Cleanup.
func NewNS(tb testing.TB, role string) *NS {
	tb.Helper()
	RequireRoot(tb)
	n, err := CreateNS(role)
	if err != nil {
		tb.Fatalf("failed to create netns: %v", err)
	}
	tb.Cleanup(func() {
		if err := n.Remove(); err != nil {
			tb.Errorf("failed to remove netns %s: %v", n.Name, err)
		}
	})
	return n
}

// CreateNS creates a bind-mounted namespace without a test; the caller
// removes it with Remove. Used by NewNS and by demo tooling.
func CreateNS(role string) (*NS, error) {
	if err := os.MkdirAll(NetNSDir, 0o755); err != nil {
		return nil, fmt.Errorf("failed to create %s: %w", NetNSDir, err)
	}
	name := randomName(NamePrefix + role + "-")
	path := filepath.Join(NetNSDir, name)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return nil, fmt.Errorf("failed to create mount point %s: %w", path, err)
	}
	f.Close()
	recordCreated(path)

	errc := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it ends inside the new namespace and
		// the runtime discards it with the goroutine.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("failed to unshare netns: %w", err)
			return
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("failed to bind mount netns on %s: %w", path, err)
			return
		}
		errc <- setLoUp()
	}()
	if err := <-errc; err != nil {
		_ = unix.Unmount(path, unix.MNT_DETACH)
		_ = os.Remove(path)
		return nil, err
	}
	h, err := ns.GetNS(path)
	if err != nil {
		_ = unix.Unmount(path, unix.MNT_DETACH)
		_ = os.Remove(path)
		return nil, fmt.Errorf("failed to open netns %s: %w", path, err)
	}
	return &NS{NetNS: h, Name: name}, nil
}

// Remove closes, unmounts and deletes the namespace. Removing a namespace
// that is already gone is not an error.
func (n *NS) Remove() error {
	path := n.Path()
	errs := []error{n.Close()}
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("failed to unmount %s: %w", path, err))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// FdNS is a network namespace held only by an open file descriptor: no mount,
// no path. It disappears when closed. Cheap enough for benchmarks.
type FdNS struct {
	// Fd is the namespace file descriptor.
	Fd int
}

// NewFdNS creates a namespace held by fd and closes it in t.Cleanup.
func NewFdNS(tb testing.TB) *FdNS {
	tb.Helper()
	RequireRoot(tb)
	n, err := CreateFdNS()
	if err != nil {
		tb.Fatalf("failed to create netns: %v", err)
	}
	tb.Cleanup(func() { _ = n.Close() })
	return n
}

// CreateFdNS creates a namespace held by fd; the caller closes it.
func CreateFdNS() (*FdNS, error) {
	type res struct {
		fd  int
		err error
	}
	c := make(chan res, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread is discarded
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			c <- res{-1, fmt.Errorf("failed to unshare netns: %w", err)}
			return
		}
		fd, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			c <- res{-1, fmt.Errorf("failed to open netns fd: %w", err)}
			return
		}
		c <- res{fd, setLoUp()}
	}()
	r := <-c
	if r.err != nil {
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
		return nil, r.err
	}
	return &FdNS{Fd: r.fd}, nil
}

// Close releases the namespace.
func (n *FdNS) Close() error { return unix.Close(n.Fd) }

// Do runs fn on a locked thread inside the namespace.
func (n *FdNS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(n.Fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("failed to enter netns: %w", err)
			return
		}
		err = fn()
		if serr := unix.Setns(orig, unix.CLONE_NEWNET); serr != nil {
			// Leave the thread locked so the runtime discards it.
			errc <- errors.Join(err, fmt.Errorf("failed to return to the original netns: %w", serr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}
