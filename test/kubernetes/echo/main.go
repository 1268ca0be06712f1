// Command echo is the Kubernetes lane's workload: a TCP echo server on
// :8080 (each connection gets its bytes back) that exits on SIGTERM
// (after -linger). With
// -unix <path> it also echoes on a unix socket at path (the app of a pod
// whose UDS socket lives in a csi.aether.io volume); the socket is made
// 0666 so a proxy without CAP_DAC_OVERRIDE could connect too. With
// -unix-greeting <line> every connection on the unix socket first gets
// that line: a connection that reads it reached the app through the socket,
// never through :8080. With -tcp-greeting <line> every connection on :8080
// first gets that line (the two-node lane passes the pod's name, so a
// client knows which backend answered); -linger <duration> keeps serving
// that long after SIGTERM (a terminating backend that still answers).
package main

import (
	"flag"
	"io"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	unixPath := flag.String("unix", "", "also echo on a unix socket at this path")
	greeting := flag.String("unix-greeting", "", "line written first on every connection of the unix socket (not on :8080)")
	tcpGreeting := flag.String("tcp-greeting", "", "line written first on every connection of :8080 (such as the pod's name)")
	linger := flag.Duration("linger", 0, "time to keep serving after SIGTERM (a terminating pod that still answers)")
	flag.Parse()
	l, err := net.Listen("tcp", ":8080")
	if err != nil {
		log.Fatalf("failed to listen on %q: %v", ":8080", err)
	}
	if *unixPath != "" {
		ul, err := net.Listen("unix", *unixPath)
		if err != nil {
			log.Fatalf("failed to listen on %q: %v", *unixPath, err)
		}
		if err := os.Chmod(*unixPath, 0o666); err != nil {
			log.Fatalf("failed to chmod socket %q: %v", *unixPath, err)
		}
		go serve(ul, *greeting)
	}
	go func() {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
		<-sigs
		time.Sleep(*linger)
		os.Exit(0)
	}()
	serve(l, *tcpGreeting)
}

// serve echoes every connection accepted on l, after writing greeting and
// a newline to it when greeting is not empty.
func serve(l net.Listener, greeting string) {
	for {
		c, err := l.Accept()
		if err != nil {
			log.Fatalf("failed to accept on %s: %v", l.Addr(), err)
		}
		go func() {
			defer c.Close()
			if greeting != "" {
				if _, err := io.WriteString(c, greeting+"\n"); err != nil {
					return
				}
			}
			_, _ = io.Copy(c, c)
		}()
	}
}
