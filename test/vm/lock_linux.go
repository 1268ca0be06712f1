package vm

import "aether.io/node/pkg/filelock"

// lockFile takes an exclusive flock on path (created if missing), shared by
// every test process on the machine, and returns its release.
func lockFile(path string) (func(), error) { return filelock.Lock(path, 0o644) }
