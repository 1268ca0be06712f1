//go:build !linux

package hbone

import (
	"io"
	"net"
	"sync"
	"syscall"
)

// copyFromSocket reads sockets through their Read off Linux: it reports
// that it did not copy.
func copyFromSocket(io.Reader, int, sendGate, func([]byte) error) (bool, error) {
	return false, nil
}

// rawSocket finds no socket to write without waiting off Linux: the server
// writes every DATA payload through the upstream's Write.
func rawSocket(net.Conn) (syscall.RawConn, func(int)) { return nil, nil }

// tryWrite is not used off Linux (rawSocket returns no socket).
func tryWrite(syscall.RawConn, []byte) (int, error) { return 0, nil }

// readSocket reads what c has into (*buf)[frameHeaderLen:] of a pooled
// buffer (through Read off Linux).
func readSocket(c net.Conn) (*[]byte, int, error) { return readConn(c) }

var sockBufs = sync.Pool{New: func() any { b := make([]byte, frameHeaderLen+sockBuf); return &b }}
