package app

import (
	"log/slog"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/xds/listener"
)

// TestListenersFollowTheInboundPolicy: each pod's listeners carry its
// inbound policy (annotation, else --inbound-policy; an invalid annotation
// is served strict and counted), and an annotation change publishes them
// again with the new policy.
func TestListenersFollowTheInboundPolicy(t *testing.T) {
	for _, def := range []string{"", meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyStrict} {
		t.Run("default="+def, func(t *testing.T) {
			l := newListenerSync(listener.Ports{}, "", slog.New(slog.DiscardHandler))
			invalid := prometheus.NewCounter(prometheus.CounterOpts{Name: "invalid"})
			l.defaultPolicy, l.invalidPolicy = def, invalid
			p := &cniv1.CNIPod{
				Namespace: "ns", Name: "web", Uid: "uid-1", ContainerId: "c1", NetworkNamespace: "/run/netns/p", Ips: []string{"10.0.0.2"},
			}
			policies := func() map[string]bool {
				out := map[string]bool{}
				for _, r := range l.cache.GetResources() {
					s, err := listener.Parse(r.(*listenerv3.Listener))
					if err != nil {
						t.Fatal(err)
					}
					out[s.InboundPolicy] = true
				}
				return out
			}
			wantDef := def
			if wantDef == "" {
				wantDef = meshcontract.InboundPolicyPermissive
			}
			steps := []struct {
				annotation string // "-" = none
				want       string
				invalid    float64
			}{
				{"-", wantDef, 0},
				{meshcontract.InboundPolicyStrict, meshcontract.InboundPolicyStrict, 0},
				{meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyPermissive, 0},
				{"Strict", meshcontract.InboundPolicyStrict, 1},
				{"-", wantDef, 1},
			}
			for i, st := range steps {
				p.Annotations = nil
				if st.annotation != "-" {
					p.Annotations = map[string]string{meshcontract.InboundPolicyAnnotation: st.annotation}
				}
				l.RecordStored(&store.Record{Pod: p})
				if got := policies(); len(got) != 1 || !got[st.want] {
					t.Errorf("step %d (annotation %q): listener policies %v, want %s", i, st.annotation, got, st.want)
				}
				var m dto.Metric
				if err := invalid.Write(&m); err != nil {
					t.Fatal(err)
				}
				if n := m.GetCounter().GetValue(); n != st.invalid {
					t.Errorf("step %d: invalid annotations counted %v, want %v", i, n, st.invalid)
				}
			}
		})
	}
}
