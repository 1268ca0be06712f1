package peercred_test

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"aether.io/node/pkg/peercred"
)

// TestRead: the server end of a unix connection reads this process's own
// uid, gid and pid; a TCP connection is refused with an error naming its
// type.
func TestRead(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "s.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	client, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	defer server.Close()
	got, err := peercred.Read(server)
	if err != nil {
		t.Fatal(err)
	}
	want := peercred.Cred{UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), PID: int32(os.Getpid())}
	if got != want {
		t.Errorf("Read = %+v, want %+v", got, want)
	}

	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer tl.Close()
	tc, err := net.Dial("tcp", tl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	if _, err := peercred.Read(tc); err == nil || !strings.Contains(err.Error(), "*net.TCPConn is not a unix connection") {
		t.Errorf("Read(tcp) = %v, want an error naming *net.TCPConn", err)
	}
}
