package proxy

import "testing"

// TestSameAddress: a handed-over own listener is taken only for the
// address the successor is configured with (any bound address for port 0).
func TestSameAddress(t *testing.T) {
	for _, tc := range []struct {
		configured, bound string
		want              bool
	}{
		{"127.0.0.1:18090", "127.0.0.1:18090", true},
		{"localhost:18090", "127.0.0.1:18090", true},
		{":18090", "[::]:18090", true},
		{"[::]:15020", "[::]:15020", true},
		{"127.0.0.1:0", "127.0.0.1:41234", true},
		{"127.0.0.1:18091", "127.0.0.1:18090", false},
		{"10.0.0.1:15020", "127.0.0.1:15020", false},
		{"127.0.0.1:18090", "not an address", false},
	} {
		if got := sameAddress(tc.configured, tc.bound); got != tc.want {
			t.Errorf("sameAddress(%q, %q) = %v, want %v", tc.configured, tc.bound, got, tc.want)
		}
	}
}
