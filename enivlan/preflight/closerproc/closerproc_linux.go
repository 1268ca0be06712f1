package closerproc

import (
	"errors"
	"syscall"
	"time"
)

// Env marks a process started as a closer ("1").
const Env = "ENI_VLAN_SOCKET_CLOSER"

// FD is the descriptor a closer inherits: its end of a unix socket pair
// whose other end only the plugin holds. The plugin sends the sockets over
// it (SCM_RIGHTS); EOF means the plugin exited.
const FD = 3

// MaxLife bounds a closer's wait for the plugin to exit; it then exits
// anyway. Either way, the kernel closes the sockets it holds as it exits,
// paying their RCU grace period there.
const MaxLife = 10 * time.Second

func init() {
	if v, _ := syscall.Getenv(Env); v == "" {
		return
	}
	hold(FD, MaxLife)
	syscall.Exit(0)
}

// hold receives descriptors on fd until EOF, an error or life has passed.
// Received descriptors are kept open: the process's exit closes them.
func hold(fd int, life time.Duration) {
	deadline := time.Now().Add(life)
	buf := make([]byte, 1)
	oob := make([]byte, syscall.CmsgSpace(8*4))
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return
		}
		tv := syscall.NsecToTimeval(left.Nanoseconds())
		if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv); err != nil {
			return
		}
		n, oobn, _, _, err := syscall.Recvmsg(fd, buf, oob, syscall.MSG_CMSG_CLOEXEC)
		if errors.Is(err, syscall.EINTR) {
			// A signal (the Go runtime's preemption among them) is not
			// the end of the wait: retry with what is left of it.
			continue
		}
		if err != nil || (n == 0 && oobn == 0) {
			return // EOF (the plugin exited), SO_RCVTIMEO (life) or a broken pair
		}
	}
}
