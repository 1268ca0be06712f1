//go:build !linux

package enivlan

import (
	"fmt"
	"os"
)

// Main reports that eni-vlan needs Linux (network namespaces, netlink,
// packet sockets) and returns 1.
func Main() int {
	fmt.Fprintln(os.Stderr, "eni-vlan: this plugin runs on Linux only")
	return 1
}
