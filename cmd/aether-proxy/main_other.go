//go:build !linux

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "aether-proxy: needs Linux (network namespaces, IP_TRANSPARENT, SO_MARK)")
	os.Exit(1)
}
