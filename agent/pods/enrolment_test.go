package pods

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/enrolment"
	"aether.io/node/registry/local"
)

// namespacedSource is a fakeSource that also knows namespace labels, as
// both real sources do.
type namespacedSource struct {
	*fakeSource
	nsMu   sync.Mutex
	labels map[string]map[string]string
}

func (s *namespacedSource) NamespaceLabels(name string) (map[string]string, bool) {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	l, ok := s.labels[name]
	return l, ok
}

func (s *namespacedSource) setNamespace(name string, labels map[string]string) {
	s.nsMu.Lock()
	defer s.nsMu.Unlock()
	s.labels[name] = labels
}

// TestNamespaceLabelFlipsTheDecision: the namespace's aether.io/managed
// label, as the source knows it at each ADD, decides for a pod without a
// label of its own (and the record says so); the pod's "false" keeps it out
// of an enrolled namespace; the Istio ambient label enrols only with the
// alias on; a system namespace stays out whatever its label.
func TestNamespaceLabelFlipsTheDecision(t *testing.T) {
	ctx := context.Background()
	managed := map[string]string{ManagedLabel: "true"}
	ambient := map[string]string{enrolment.AmbientLabel: enrolment.AmbientValue}
	for _, tt := range []struct {
		name      string
		rules     enrolment.Rules
		ns        string
		podLabels map[string]string
		nsLabels  []map[string]string // one ADD (a new sandbox) per entry
		want      []enrolment.Via     // "" = RESULT_IGNORED
	}{
		{
			"namespace label on, off, on",
			enrolment.Rules{},
			"shop", nil,
			[]map[string]string{nil, managed, nil, managed},
			[]enrolment.Via{"", enrolment.ViaNamespaceLabel, "", enrolment.ViaNamespaceLabel},
		},
		{
			"pod opts out",
			enrolment.Rules{},
			"shop",
			map[string]string{ManagedLabel: "false"},
			[]map[string]string{managed, nil},
			[]enrolment.Via{"", ""},
		},
		{
			"pod label whatever the namespace",
			enrolment.Rules{},
			"shop", managed,
			[]map[string]string{nil, managed},
			[]enrolment.Via{enrolment.ViaPodLabel, enrolment.ViaPodLabel},
		},
		{
			"ambient label, alias off",
			enrolment.Rules{},
			"shop", nil,
			[]map[string]string{ambient},
			[]enrolment.Via{""},
		},
		{
			"ambient label, alias on",
			enrolment.Rules{AmbientAlias: true},
			"shop", nil,
			[]map[string]string{ambient, nil},
			[]enrolment.Via{enrolment.ViaNamespaceAmbient, ""},
		},
		{
			"system namespace",
			enrolment.Rules{SystemNamespaces: enrolment.DefaultSystemNamespaces},
			"kube-system", nil,
			[]map[string]string{managed},
			[]enrolment.Via{""},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			st, err := store.Open(t.TempDir(), store.Options{NoSync: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			src := &namespacedSource{fakeSource: newFakeSource(), labels: map[string]map[string]string{}}
			src.set(&podsource.Pod{Namespace: tt.ns, Name: "web", UID: "u1", NodeName: "n", Labels: tt.podLabels})
			live := true
			m := New(Config{Node: "n", PodWait: 200 * time.Millisecond, Enrolment: tt.rules}, st, local.New(), src, alwaysHealthy{healthy: &live}, nil, nil)
			for i, labels := range tt.nsLabels {
				src.setNamespace(tt.ns, labels)
				key := fmt.Sprintf("c%d", i)
				pod := &cniv1.CNIPod{Namespace: tt.ns, Name: "web", ContainerId: key, NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}}
				res, err := m.AddPod(ctx, pod, nil)
				if err != nil {
					t.Fatalf("ADD %d: %v", i, err)
				}
				s, stored := m.Get(key)
				switch want := tt.want[i]; {
				case want == "" && (res != cniv1.AddPodResponse_RESULT_IGNORED || stored):
					t.Errorf("ADD %d with namespace labels %v: %v (stored %v), want RESULT_IGNORED and no record", i, labels, res, stored)
				case want != "" && (res != cniv1.AddPodResponse_RESULT_SUCCESS || !stored):
					t.Errorf("ADD %d with namespace labels %v: %v (stored %v), want RESULT_SUCCESS", i, labels, res, stored)
				case want != "" && s.Record.EnrolledVia != string(want):
					t.Errorf("ADD %d: record enrolled via %q, want %q", i, s.Record.EnrolledVia, want)
				}
			}
		})
	}
}
