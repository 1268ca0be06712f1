package readiness_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"aether.io/node/pkg/readiness"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// listen binds 127.0.0.1:port inside the pod netns.
func listen(t *testing.T, pod *harness.NS, port string) net.Listener {
	t.Helper()
	var l net.Listener
	pod.MustDo(t, func() error {
		var err error
		l, err = net.Listen("tcp", "127.0.0.1:"+port)
		return err
	})
	t.Cleanup(func() { l.Close() })
	return l
}

func TestProbe(t *testing.T) {
	p := readiness.Prober{Interval: 10 * time.Millisecond, PerRequest: 200 * time.Millisecond}
	url := "http://127.0.0.1:18081/aether/readyz"

	t.Run("503 then 200", func(t *testing.T) {
		pod := harness.NewNS(t, "prb")
		var n atomic.Int32
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/aether/readyz" {
				w.WriteHeader(http.StatusNotFound)
				return
			}
			if n.Add(1) < 3 {
				w.WriteHeader(http.StatusServiceUnavailable) // draining epoch
				return
			}
			w.WriteHeader(http.StatusOK)
		})}
		go srv.Serve(listen(t, pod, "18081"))
		t.Cleanup(func() { srv.Close() })
		if err := p.Probe(context.Background(), pod.Path(), url, 10*time.Second); err != nil {
			t.Fatalf("Probe = %v", err)
		}
		if n.Load() < 3 {
			t.Fatalf("probe stopped before a 200 (requests: %d)", n.Load())
		}
	})
	t.Run("the last non-200 is the error", func(t *testing.T) {
		pod := harness.NewNS(t, "prb")
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusServiceUnavailable)
		})}
		go srv.Serve(listen(t, pod, "18081"))
		t.Cleanup(func() { srv.Close() })
		// One attempt within the budget: its answer is the last failure.
		once := readiness.Prober{Interval: time.Minute, PerRequest: 5 * time.Second}
		err := once.Probe(context.Background(), pod.Path(), url, time.Second)
		if err == nil || !strings.Contains(err.Error(), "answered 503 Service Unavailable") {
			t.Fatalf("Probe = %v, want the 503 named", err)
		}
	})
	t.Run("tcp accept without http is not ready", func(t *testing.T) {
		pod := harness.NewNS(t, "prb")
		listen(t, pod, "18081") // handshakes complete in the backlog; nobody answers
		if err := p.Probe(context.Background(), pod.Path(), url, 500*time.Millisecond); err == nil {
			t.Fatal("Probe passed on a listener that never answers HTTP")
		}
	})
	t.Run("nothing listening", func(t *testing.T) {
		pod := harness.NewNS(t, "prb")
		if err := p.Probe(context.Background(), pod.Path(), url, 300*time.Millisecond); err == nil {
			t.Fatal("Probe passed with no listener")
		}
	})
	t.Run("listener outside the pod netns is not seen", func(t *testing.T) {
		pod := harness.NewNS(t, "prb")
		other := harness.NewNS(t, "prb")
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {})}
		go srv.Serve(listen(t, other, "18081"))
		t.Cleanup(func() { srv.Close() })
		if err := p.Probe(context.Background(), pod.Path(), url, 300*time.Millisecond); err == nil {
			t.Fatal("Probe reached a listener in another netns")
		}
	})
}
