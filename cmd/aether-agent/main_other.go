//go:build !linux

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "aether-agent: needs Linux (SO_PEERCRED, network namespaces)")
	os.Exit(1)
}
