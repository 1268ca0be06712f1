package harness

import (
	"os"
	"testing"
)

// RequireRoot skips the test with a clear message unless it runs as root.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root (network namespaces, links and mounts); run `make test` as root, as CI does")
	}
}
