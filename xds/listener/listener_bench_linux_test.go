package listener_test

import (
	"testing"

	"aether.io/node/xds/listener"
)

// BenchmarkBuild is the agent's per-AddPod cost of a dual-stack pod's
// listeners (it runs under the agent's lifecycle lock).
func BenchmarkBuild(b *testing.B) {
	p := pod("10.0.0.2", "fd00::2")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := listener.Build(p); err != nil {
			b.Fatal(err)
		}
	}
}
