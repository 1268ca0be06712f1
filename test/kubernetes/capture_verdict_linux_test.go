package kubernetes_test

import (
	"net/netip"
	"strings"
	"testing"
)

// TestOnlyTLSTo checks the fabric capture's verdicts on made-up segments:
// TLS to the port passes (out of order, retransmitted), anything else fails.
func TestOnlyTLSTo(t *testing.T) {
	client := netip.MustParseAddrPort("10.244.1.2:40000")
	server := netip.MustParseAddrPort("10.244.2.3:15008")
	hello := []byte{22, 3, 1, 0, 4, 1, 2, 3, 4}
	appData := []byte{23, 3, 3, 0, 2, 9, 9}
	tls := []segment{
		{src: client, dst: server, seq: 99, syn: true},
		{src: client, dst: server, seq: 100 + uint32(len(hello)), payload: appData},
		{src: client, dst: server, seq: 100, payload: hello},
		{src: client, dst: server, seq: 100, payload: hello}, // retransmitted
	}
	if conns, data, err := onlyTLSTo(tls, 15008, []byte("hello")); err != nil || conns != 1 || data != 3 {
		t.Fatalf("a TLS connection: %d connection(s), %d data segment(s), %v; want 1, 3, nil", conns, data, err)
	}
	plainDst := netip.MustParseAddrPort("10.244.2.3:8080")
	for name, c := range map[string]struct {
		segs []segment
		want string
	}{
		"another port":     {[]segment{{src: client, dst: plainDst, seq: 1, payload: []byte("x")}}, "not to or from :15008"},
		"cleartext bytes":  {[]segment{{src: client, dst: server, seq: 1, payload: []byte("say hello")}}, "in the clear"},
		"not TLS":          {[]segment{{src: client, dst: server, seq: 9, syn: true}, {src: client, dst: server, seq: 10, payload: []byte("GET / HTTP/1.1")}}, "not a TLS record"},
		"no handshake":     {[]segment{{src: client, dst: server, seq: 9, syn: true}, {src: client, dst: server, seq: 10, payload: appData}}, "not a handshake"},
		"a missed segment": {[]segment{{src: client, dst: server, seq: 9, syn: true}, {src: client, dst: server, seq: 20, payload: appData}}, "missed"},
	} {
		if _, _, err := onlyTLSTo(c.segs, 15008, []byte("hello")); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, c.want)
		}
	}
}
