package pin_test

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"

	"aether.io/node/meshcni/pin"
)

// safe is the rule Name applies by hand; the test keeps the two equal.
var safe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// TestNameMatchesRule: a container ID is its own pin name exactly when it
// matches the rule; otherwise the name is sha256-<64 hex digits>.
func TestNameMatchesRule(t *testing.T) {
	cases := []string{
		"", "a", "A", "0", "_a", ".a", "-a", "a_", "a.", "a-", "a/b", "a b", "..", "é",
		strings.Repeat("a", 127), strings.Repeat("a", 128), strings.Repeat("a", 129),
		"4f2b1c0d9e8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c",
	}
	alphabet := []byte("aZ09_.-/ \x00é")
	r := rand.New(rand.NewPCG(1, 2))
	for range 5000 {
		b := make([]byte, r.IntN(140))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		cases = append(cases, string(b))
	}
	for _, id := range cases {
		got := pin.Name(id)
		if safe.MatchString(id) {
			if got != id {
				t.Fatalf("Name(%q) = %q, want the ID itself", id, got)
			}
			continue
		}
		h, ok := strings.CutPrefix(got, "sha256-")
		if !ok || len(h) != 64 || strings.Trim(h, "0123456789abcdef") != "" {
			t.Fatalf("Name(%q) = %q, want sha256-<its SHA-256 in hex>", id, got)
		}
	}
}
