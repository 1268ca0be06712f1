package capture_test

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"aether.io/node/pkg/capture"
	"aether.io/node/test/harness"
)

// routingState is the namespace's ip rules and routes of every table.
func routingState(t *testing.T, pod *harness.NS) string {
	t.Helper()
	var b strings.Builder
	for _, args := range [][]string{
		{"ip", "-4", "rule"},
		{"ip", "-6", "rule"},
		{"ip", "-4", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"},
	} {
		pod.MustDo(t, func() error {
			out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
			if err != nil {
				return fmt.Errorf("%v: %w: %s", args, err, out)
			}
			fmt.Fprintf(&b, "## %s\n%s", strings.Join(args, " "), out)
			return nil
		})
	}
	return b.String()
}

// TestChangedMarksLeaveNoStaleRule: a divert installed again with another
// divert mark and route table (the netconf changed between two ADDs)
// replaces the old fwmark rules and the old table's local routes, and a
// DEL whose netconf differs from its ADD's still removes everything.
func TestChangedMarksLeaveNoStaleRule(t *testing.T) {
	pod, _ := topology(t)
	inst := capture.Installer{}
	before := routingState(t, pod)
	oldCfg := capture.Build(capture.Config{RedirectAll: true})
	newCfg := capture.Build(capture.Config{RedirectAll: true, DivertMark: 0x20, RouteTable: 200})
	if err := inst.Install(pod.Path(), oldCfg); err != nil {
		t.Fatal(err)
	}
	if err := inst.Install(pod.Path(), newCfg); err != nil {
		t.Fatal(err)
	}
	after := routingState(t, pod)
	for _, stale := range []string{"fwmark 0xae7f", "table 133"} {
		if strings.Contains(after, stale) {
			t.Errorf("%q left behind after the divert was installed with new marks:\n%s", stale, after)
		}
	}
	for _, want := range []string{"fwmark 0x20 lookup 200", "table 200"} {
		if !strings.Contains(after, want) {
			t.Errorf("%q missing after the new install:\n%s", want, after)
		}
	}
	if err := inst.Verify(pod.Path(), newCfg); err != nil {
		t.Fatalf("verify the new divert: %v", err)
	}
	// The DEL carries the old netconf: the new marks go too.
	if err := inst.Remove(pod.Path(), oldCfg.Config); err != nil {
		t.Fatal(err)
	}
	if got := routingState(t, pod); got != before {
		t.Fatalf("remove with the old netconf left state behind:\n--- before\n%s\n--- after\n%s", before, got)
	}
}
