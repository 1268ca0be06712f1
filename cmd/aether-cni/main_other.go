//go:build !linux

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "aether-cni: needs Linux (network namespaces, nftables, policy routing)")
	os.Exit(1)
}
