package link

import (
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestVLANVerify(t *testing.T) {
	attrs := netlink.LinkAttrs{Name: "eth0"}
	tests := []struct {
		name string
		l    netlink.Link
		vlan int
		want string
	}{
		{"matching vlan", &netlink.Vlan{LinkAttrs: attrs, VlanId: 100}, 100, ""},
		{"other vlan id", &netlink.Vlan{LinkAttrs: attrs, VlanId: 101}, 100, "VLAN ID 101, want 100"},
		{"not a vlan", &netlink.Macvlan{LinkAttrs: attrs}, 100, "is a macvlan, want a vlan"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := VLAN{}.Verify(tt.l, tt.vlan)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Verify: %v, want %q", err, tt.want)
			}
		})
	}
	if a := (VLAN{}).Alias(100); a != "" {
		t.Errorf("VLAN alias = %q, want none: the VLAN ID is the link's own", a)
	}
	if (VLAN{}).Surrogate() || Default().Surrogate() != (SurrogateBanner != "") {
		t.Error("production Linker reports itself as surrogate, or Default and the banner disagree")
	}
}
