//go:build !linux

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "aether-csi: needs Linux (bind mounts, /proc/self/mountinfo)")
	os.Exit(1)
}
