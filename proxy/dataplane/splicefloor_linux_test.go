package dataplane_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"aether.io/node/proxy/proxytest"
)

// The splice floor: the least a user-space relay in the client pod pays for
// the plaintext proxied path's two TCP connections, as a floor for
// BenchmarkProxyThroughput. It listens on the client pod's address (the
// client reaches it over the pod's lo with the bypass mark, so no capture
// divert and no TPROXY), dials the destination with the bypass mark as the
// proxy does, and copies each way the way a C relay would: a thread of its
// own per direction, blocking sockets, blocking splice(2) socket → 1 MiB pipe
// → socket (SPLICE_F_MOVE, as the proxy), no netpoller, no limits, no
// accounting. What ours costs above it is the capture (divert, policy
// routing, TPROXY) and the proxy's own loop; what it costs above direct is
// the second TCP connection and the two splices.
const spliceFloorPort = 15012

// startSpliceFloor runs the floor relay in from, forwarding to dst, and
// returns the address the client dials (with the bypass mark). A copy that
// fails shuts both connections down and resets them, so the upload sees it
// (a short count or an error) and fails the benchmark.
func startSpliceFloor(tb testing.TB, from *proxytest.Pod, dst netip.AddrPort) netip.AddrPort {
	tb.Helper()
	from.Handle(tb, spliceFloorPort, func(c net.Conn) {
		down := c.(*net.TCPConn)
		up, err := markedDial(context.Background(), from, dst)
		if err != nil {
			_ = down.SetLinger(0)
			return
		}
		defer up.Close()
		var once sync.Once
		abort := func() {
			once.Do(func() {
				for _, s := range []*net.TCPConn{down, up} {
					_ = s.SetLinger(0)
					_ = s.CloseRead() // ends a splice blocked on it (shutdown acts on the socket, not the descriptor)
					_ = s.CloseWrite()
				}
			})
		}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			if blockingSplice(down, up) != nil {
				abort()
			}
		}()
		if blockingSplice(up, down) != nil {
			abort()
		}
		wg.Wait()
	})
	return netip.AddrPortFrom(from.IP4, spliceFloorPort)
}

// blockingSplice copies src to dst until src's EOF, then half-closes dst. It
// runs on a locked thread with both sockets in blocking mode (the
// descriptors of File share the connections' file descriptions, so the
// connections themselves are only closed afterwards, never read).
func blockingSplice(dst, src *net.TCPConn) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	sf, err := src.File()
	if err != nil {
		return err
	}
	defer sf.Close()
	df, err := dst.File()
	if err != nil {
		return err
	}
	defer df.Close()
	sfd, dfd := int(sf.Fd()), int(df.Fd()) // Fd: blocking mode
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return os.NewSyscallError("pipe2", err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	size, err := unix.FcntlInt(uintptr(p[1]), unix.F_SETPIPE_SZ, 1<<20)
	if err != nil {
		return os.NewSyscallError("fcntl F_SETPIPE_SZ", err)
	}
	for {
		n, err := unix.Splice(sfd, nil, p[1], nil, size, unix.SPLICE_F_MOVE)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return os.NewSyscallError("splice", err)
		}
		if n == 0 {
			return os.NewSyscallError("shutdown", unix.Shutdown(dfd, unix.SHUT_WR))
		}
		for n > 0 {
			m, err := unix.Splice(p[0], nil, dfd, nil, int(n), unix.SPLICE_F_MOVE)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				return os.NewSyscallError("splice", err)
			}
			n -= m
		}
	}
}
