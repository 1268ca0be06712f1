package meshcontract

import "testing"

func TestSPIFFEID(t *testing.T) {
	if got, want := SPIFFEID("cluster.local", "shop", "web"), "spiffe://cluster.local/ns/shop/sa/web"; got != want {
		t.Errorf("SPIFFEID = %q, want %q", got, want)
	}
}
