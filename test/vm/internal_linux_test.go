package vm

import (
	"strings"
	"testing"
)

func TestCrashHints(t *testing.T) {
	out := "aether-init: started at kernel uptime 2s\n=== RUN   TestA\n=== RUN   TestB/sub\n[ 9.1] Kernel panic - not syncing: Attempted to kill init!\n"
	got := crashHints(out)
	for _, want := range []string{"last test started: TestB/sub", "Kernel panic - not syncing"} {
		if !strings.Contains(got, want) {
			t.Errorf("crashHints = %q, want it to contain %q", got, want)
		}
	}
	if got := crashHints("[ 0.1] early\n"); !strings.Contains(got, "/init never started") {
		t.Errorf("crashHints without /init = %q", got)
	}
}

func TestSoftdepPre(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"pre: crc32c", []string{"crc32c"}},
		{"pre: a b post: c", []string{"a", "b"}},
		{"post: c pre: d", []string{"d"}},
		{"post: c", nil},
	} {
		got := softdepPre(tc.in)
		if len(got) != len(tc.want) {
			t.Errorf("softdepPre(%q) = %v, want %v", tc.in, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("softdepPre(%q) = %v, want %v", tc.in, got, tc.want)
			}
		}
	}
}
