package istio

import (
	"context"
	"net"
	"testing"

	istiohbone "istio.io/istio/pkg/hbone"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

// BenchmarkHBONEIstioThroughput: bulk upload over mTLS HBONE on loopback to
// the same app: our Dialer → our Server (ours) vs Istio's Go dialer →
// Istio's Go server (peer), same certificates, one warm stream each.
func BenchmarkHBONEIstioThroughput(b *testing.B) {
	p := newPKI(b)
	dst := hbonetest.Sink(b)
	ourProxy := p.ourServer(b, nil)
	istioProxy := p.istioServer(b)
	d := p.ourDialer(b)
	chunk := make([]byte, 256<<10)
	for _, mode := range []string{"ours", "peer"} {
		b.Run(mode, func(b *testing.B) {
			var c net.Conn
			var err error
			if mode == "ours" {
				c, err = d.Dial(context.Background(), hbone.Request{Source: clientID, Proxy: ourProxy, Target: dst, Expected: serverID})
			} else {
				id := istiohbone.NewDialer(istiohbone.Config{ProxyAddress: istioProxy.String(), TLS: p.istioClientTLS(b)})
				c, err = id.DialContext(context.Background(), "tcp", dst.String())
			}
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			hbonetest.Throughput(b, c, chunk)
		})
	}
}
