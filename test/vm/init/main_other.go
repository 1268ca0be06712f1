//go:build !linux

package main

import (
	"fmt"
	"os"
)

// The VM /init only runs as PID 1 of a Linux guest.
func main() {
	fmt.Fprintln(os.Stderr, "aether-init: runs only as /init of the Linux VM lane")
	os.Exit(1)
}
