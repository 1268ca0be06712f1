package deploy_test

import (
	"slices"
	"testing"
)

// TestHBONEDeclaredPortsOnlyValue: proxy.hboneDeclaredPortsOnly is off by
// default (aether-proxy gets no -hbone-declared-ports-only) and, set
// (inbound-strict), passes the flag once.
func TestHBONEDeclaredPortsOnlyValue(t *testing.T) {
	const flag = "-hbone-declared-ports-only"
	for set, want := range map[string]int{"default": 0, "inbound-strict": 1} {
		t.Run(set, func(t *testing.T) {
			r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == set })])
			args := container(t, r, "aether-proxy").Args
			if got := len(slices.DeleteFunc(slices.Clone(args), func(a string) bool { return a != flag })); got != want {
				t.Errorf("aether-proxy args %q carry %s %d times, want %d", args, flag, got, want)
			}
		})
	}
}
