package vm_test

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"aether.io/node/test/vm"
)

// fatalTB records the first Fatal and ends the goroutine, as testing.T does.
type fatalTB struct {
	testing.TB
	mu  sync.Mutex
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.msg = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

func (f *fatalTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }

// TestMissingQemuFailsLoudly runs Run with a PATH that has no qemu: it must
// fail (never skip) and say which package to install.
func TestMissingQemuFailsLoudly(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		vm.Run(f, vm.Options{TestBinary: "/nonexistent"})
	}()
	<-done
	if !strings.Contains(f.msg, "apt-get install -y qemu-system-x86") {
		t.Fatalf("Run without qemu reported %q, want a failure naming qemu-system-x86", f.msg)
	}
}
