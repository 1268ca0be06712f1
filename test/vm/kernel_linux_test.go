package vm_test

import (
	"debug/elf"
	"slices"
	"testing"

	"aether.io/node/test/vm"
)

// TestKernelModulesLoadOrder resolves the lane's modules from the real
// Debian kernel package and checks that every dependency (from .modinfo
// depends= and softdep pre:) comes before the module needing it.
func TestKernelModulesLoadOrder(t *testing.T) {
	k := vm.FetchKernel(t)
	f, err := elf.Open(k.Vmlinux)
	if err != nil {
		t.Fatalf("vmlinux %s is not ELF: %v", k.Vmlinux, err)
	}
	f.Close()
	mods, err := k.Modules(vm.DefaultModules...)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range mods {
		names = append(names, m.Name)
	}
	t.Logf("load order: %v", names)
	before := func(a, b string) {
		t.Helper()
		i, j := slices.Index(names, a), slices.Index(names, b)
		if i < 0 || j < 0 || i > j {
			t.Errorf("%s must load before %s; order %v", a, b, names)
		}
	}
	before("llc", "stp")
	before("stp", "garp")
	before("garp", "8021q")
	before("mrp", "8021q")
	before("nfnetlink", "nf_tables")
	before("libcrc32c", "nf_tables")
	before("crc32c_generic", "libcrc32c")
	before("nf_conntrack", "nft_ct")
	before("nft_reject", "nft_reject_inet")
	for _, n := range []string{"veth", "8021q", "nf_tables", "nft_ct"} {
		if !slices.Contains(names, n) {
			t.Errorf("%s missing from %v", n, names)
		}
	}
	for _, n := range []string{"af_packet", "ipv6"} {
		if !k.Builtin(n) || slices.Contains(names, n) {
			t.Errorf("%s: builtin=%v, in the load list=%v; want built in and not loaded", n, k.Builtin(n), slices.Contains(names, n))
		}
	}
	if _, err := k.Modules("no_such_module_xyz"); err == nil {
		t.Error("an unknown module resolved without error")
	}
}
