package closerproc

import (
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// devNulls lists this process's descriptors open on /dev/null.
func devNulls(t *testing.T) map[int]bool {
	t.Helper()
	e, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	fds := map[int]bool{}
	for _, d := range e {
		if target, _ := os.Readlink("/proc/self/fd/" + d.Name()); target == os.DevNull {
			n, _ := strconv.Atoi(d.Name())
			fds[n] = true
		}
	}
	return fds
}

// TestHold: hold keeps every descriptor it is sent and returns on EOF (the
// plugin exited) or when its life is over, whichever comes first.
func TestHold(t *testing.T) {
	for _, tt := range []struct {
		name  string
		send  int  // descriptors the plugin sends
		close bool // the plugin's end closes (else life ends the hold)
	}{
		{name: "EOF", close: true},
		{name: "descriptors then EOF", send: 2, close: true},
		{name: "life", send: 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pair, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			plugin, closer := pair[0], pair[1]
			t.Cleanup(func() { _ = syscall.Close(closer) })
			var sent []int
			for range tt.send {
				f, err := os.Open(os.DevNull)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = f.Close() })
				sent = append(sent, int(f.Fd()))
			}
			if len(sent) > 0 {
				if err := syscall.Sendmsg(plugin, []byte{0}, syscall.UnixRights(sent...), nil, 0); err != nil {
					t.Fatal(err)
				}
			}
			life := time.Hour
			if tt.close {
				if err := syscall.Close(plugin); err != nil {
					t.Fatal(err)
				}
			} else {
				t.Cleanup(func() { _ = syscall.Close(plugin) })
				life = 50 * time.Millisecond
			}
			before := devNulls(t)
			hold(closer, life)
			var kept []int
			for fd := range devNulls(t) {
				if !before[fd] {
					kept = append(kept, fd)
				}
			}
			t.Cleanup(func() {
				for _, fd := range kept {
					_ = syscall.Close(fd)
				}
			})
			if len(kept) != tt.send {
				t.Errorf("hold kept %d descriptors, want %d", len(kept), tt.send)
			}
		})
	}
}
