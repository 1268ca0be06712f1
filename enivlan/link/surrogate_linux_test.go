//go:build enivlan_surrogate_link

package link

import (
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestSurrogateVerify(t *testing.T) {
	ok := &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0", Alias: aliasPrefix + "100"}}
	if err := (Macvlan{}).Verify(ok, 100); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		l    netlink.Link
		want string
	}{
		{ok, "VLAN ID 100, want 7"},
		{&netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}}, "no surrogate VLAN record"},
		{&netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, VlanId: 7}, "want a macvlan surrogate"},
	} {
		if err := (Macvlan{}).Verify(tt.l, 7); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Verify: %v, want %q", err, tt.want)
		}
	}
	if got := (Macvlan{}).Alias(100); got != aliasPrefix+"100" {
		t.Errorf("Alias(100) = %q, want %q: Verify reads it back", got, aliasPrefix+"100")
	}
	if !Default().Surrogate() || SurrogateBanner == "" {
		t.Error("the tagged build must select the surrogate and carry the banner")
	}
}
