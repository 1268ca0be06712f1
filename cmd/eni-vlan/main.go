// Command eni-vlan is the IaaS sub-ENI CNI plugin; its logic lives in
// aether.io/node/enivlan (see enivlan/README.md).
package main

import (
	"os"
	"runtime"

	"aether.io/node/enivlan"
)

func init() {
	// Namespace switches must stay on one OS thread.
	runtime.LockOSThread()
}

func main() { os.Exit(enivlan.Main()) }
