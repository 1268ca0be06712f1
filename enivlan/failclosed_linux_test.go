package enivlan_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/test/harness"
)

// runMany runs n ADDs spread over workers, each worker reusing one pod
// netns (a failed ADD must leave it empty), and returns the errors.
func runMany(t *testing.T, e *env, n, workers int, bind func(worker int, p harness.Pod)) ([]error, []*harness.NS) {
	t.Helper()
	nss := make([]*harness.NS, workers)
	for i := range nss {
		nss[i] = harness.NewNS(t, "pod")
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: nss[w].Path(), Name: fmt.Sprintf("fc-%d", i), Namespace: "default", UID: fmt.Sprintf("uid-fc-%d", i)}
				bind(w, p)
				_, errs[i] = e.rt.Add(context.Background(), p)
			}
		}()
	}
	wg.Wait()
	return errs, nss
}

// TestFailClosed1000 is issue 5's must-show: 1000 ADDs against a fabric
// that never answers leave no IP in host-local's store, no link and no VLAN
// device; the same with an agent that answers 404 until the budget ends.
func TestFailClosed1000(t *testing.T) {
	if testing.Short() {
		t.Skip("1000 ADDs; skipped with -short")
	}
	const n, workers = 1000, 4
	t.Run("fabric never answers", func(t *testing.T) {
		e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{"validationRetries": 2, "validationTimeoutMs": 2})
		// One VLAN per worker: Linux allows one device per (master, VLAN
		// ID), so concurrent pods on one VLAN are refused (tested elsewhere).
		errs, nss := runMany(t, e, n, workers, func(w int, p harness.Pod) {
			e.cloud.Bind(p, enivlantest.Binding{VLAN: 100 + w, MAC: randomMAC(), NotEffective: true})
		})
		for i, err := range errs {
			if err == nil {
				t.Fatalf("ADD %d succeeded against a fabric that never answers", i)
			}
			if cniCode(err) != 11 || !strings.Contains(err.Error(), "cloud binding not effective: no reply from gateway 10.77.0.1") {
				t.Fatalf("ADD %d: unexpected error (code %d): %v", i, cniCode(err), err)
			}
		}
		e.assertClean(t, nss...)
	})
	t.Run("agent 404 until the budget ends", func(t *testing.T) {
		e := newEnv(t, "1.0.0", enivlantest.CloudOptions{}, map[string]any{"endpointTimeoutMs": 60})
		errs, nss := runMany(t, e, n, workers, func(_ int, p harness.Pod) {
			e.cloud.Bind(p, enivlantest.Binding{VLAN: 100, MAC: randomMAC(), Answer: enivlantest.NotFound})
		})
		saw404 := 0
		for i, err := range errs {
			if err == nil || cniCode(err) != 11 || !strings.Contains(err.Error(), "failed to get the cloud binding of pod default/fc-") {
				t.Fatalf("ADD %d: want code 11 naming the pod, got (code %d) %v", i, cniCode(err), err)
			}
			if strings.Contains(err.Error(), "HTTP 404") {
				saw404++
			}
		}
		// Under CPU contention a call can be cut by the budget before its
		// answer arrives; the agent's 404 must still show through.
		if saw404 < n/10 {
			t.Errorf("only %d of %d errors report the agent's 404", saw404, n)
		}
		e.assertClean(t, nss...)
	})
}
