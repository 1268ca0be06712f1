package sockclosertest

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Target returns what descriptor fd of process pid is open on (for a
// socket, "socket:[inode]").
func Target(tb testing.TB, pid, fd int) string {
	tb.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	if err != nil {
		tb.Fatal(err)
	}
	return l
}

// FDs returns what each descriptor of process pid is open on.
func FDs(tb testing.TB, pid int) map[int]string {
	tb.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		tb.Fatal(err)
	}
	out := map[int]string{}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			tb.Fatal(err)
		}
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
			out[fd] = l
		}
	}
	return out
}

// Holders returns the processes with a descriptor on any of ids.
func Holders(tb testing.TB, ids []string) []int {
	tb.Helper()
	procs, err := os.ReadDir("/proc")
	if err != nil {
		tb.Fatal(err)
	}
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		ents, err := os.ReadDir(filepath.Join("/proc", p.Name(), "fd"))
		if err != nil {
			continue // gone, or a kernel thread
		}
		for _, e := range ents {
			if l, err := os.Readlink(filepath.Join("/proc", p.Name(), "fd", e.Name())); err == nil && slices.Contains(ids, l) {
				out = append(out, pid)
				break
			}
		}
	}
	return out
}

// WaitHeld waits until process pid holds every one of ids (in flight until
// a closer receives them) and returns its descriptors; the test's deadline
// bounds the wait.
func WaitHeld(tb testing.TB, pid int, ids []string) map[int]string {
	tb.Helper()
	for {
		fds := FDs(tb, pid)
		held := 0
		for _, l := range fds {
			if slices.Contains(ids, l) {
				held++
			}
		}
		if held == len(ids) {
			return fds
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Reap waits for the child process pid (a closer, a child of the test
// until it exits) and returns how it ended.
func Reap(tb testing.TB, pid int) syscall.WaitStatus {
	tb.Helper()
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
		tb.Fatalf("wait for closer %d: %v", pid, err)
	}
	return ws
}

// pairFD is the descriptor a closer holds its end of the pair on.
const pairFD = 3

// CheckCloser makes tb fail unless process pid is a closer named name
// holding exactly ids: its command line and memfd executable carry name, it
// runs in its own session with an empty environment, and holds stdio on
// /dev/null, its end of the pair on descriptor 3 and ids, nothing else (not
// a descriptor its parent leaked to it).
func CheckCloser(tb testing.TB, pid int, name string, ids []string) {
	tb.Helper()
	fds := WaitHeld(tb, pid, ids)
	for fd, l := range fds {
		switch {
		case fd < pairFD && l == os.DevNull:
		case fd == pairFD && strings.HasPrefix(l, "socket:"):
		case fd > pairFD && slices.Contains(ids, l):
		default:
			tb.Errorf("closer fd %d = %q; want stdio on /dev/null, the pair on %d, %v", fd, l, pairFD, ids)
		}
	}
	if len(fds) != pairFD+1+len(ids) {
		tb.Errorf("closer descriptors %v, want %d", fds, pairFD+1+len(ids))
	}
	if env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid)); err != nil || len(env) != 0 {
		tb.Errorf("closer environment = %q, %v; want empty", env, err)
	}
	if emu := os.Getenv(EmulatorEnv); emu != "" {
		checkEmulated(tb, pid, name, emu)
	} else {
		if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || string(cmd) != name+"\x00" {
			tb.Errorf("closer command line = %q, %v; want %s", cmd, err, name)
		}
		if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || !strings.Contains(exe, "memfd:"+name) {
			tb.Errorf("closer executable = %q, %v; want the memfd %s", exe, err, name)
		}
	}
	if sid, err := unix.Getsid(pid); err != nil || sid != pid {
		tb.Errorf("closer session = %d, %v; want its own (%d)", sid, err, pid)
	}
}

// checkEmulated makes tb fail unless process pid is the user-mode emulator
// emu (EmulatorEnv) running the memfd named name: the kernel started the
// emulator for the closer's executable (binfmt_misc), so the process's
// executable and command line are the emulator's, and the closer's image
// is a mapping of the memfd.
func checkEmulated(tb testing.TB, pid int, name, emu string) {
	tb.Helper()
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || exe != emu {
		tb.Errorf("emulated closer executable = %q, %v; want %s", exe, err, emu)
	}
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || !strings.HasPrefix(string(cmd), emu+"\x00") {
		tb.Errorf("emulated closer command line = %q, %v; want %s and the closer's path", cmd, err, emu)
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil || !strings.Contains(string(maps), "/memfd:"+name+" ") {
		tb.Errorf("emulated closer maps no memfd %s (%v):\n%s", name, err, maps)
	}
}
