// Package pin keeps a pod's network namespace alive independently of the
// container runtime: a bind mount of the netns file under a pin directory,
// one per container, so the proxy's per-pod sockets never race the runtime's
// teardown. Pins are removed after DEL (at once or after a delay, by a
// detached helper process) and by CNI GC for containers no longer valid.
package pin
