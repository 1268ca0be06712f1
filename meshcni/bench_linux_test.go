package meshcni_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	cnins "github.com/containernetworking/plugins/pkg/ns"

	"aether.io/node/meshcni"
	"aether.io/node/meshcni/meshcnitest"
	"aether.io/node/meshcni/pin"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/capture/capturetest"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// BenchmarkMeshAdd compares one pod ADD of our chained step with an
// Istio-equivalent one, both in-process against in-process servers on unix
// sockets, each in a fresh pod netns (created outside the measurement):
//
//   - ours: meshcni.Plugin.Add with its real dependencies: netns pin (bind
//     mount), AddPod over gRPC on a new connection, the capture divert (one
//     nftables netlink batch + IPv4/IPv6 policy routing), ReportAddResult;
//     readiness probe and CRI lookup off.
//   - peer: what istio-cni's plugin + node agent do for a pod: an HTTP POST
//     of the pod over a unix socket (new connection), whose handler execs
//     `nft -f` with the Istio-sized in-pod ruleset inside the pod netns.
func BenchmarkMeshAdd(b *testing.B) {
	harness.RequireRoot(b)
	dir := b.TempDir()

	b.Run("ours", func(b *testing.B) { runMeshAdd(b, dir, nil, []int{22}) })
	// A retried ADD whose first attempt installed a divert with two
	// exclusions more (the retry deletes their rules): the whole ADD,
	// including the wait for the socket closer's start at its end, as the
	// plugin's exit waits for it; the closer is then ended and reaped
	// outside the measurement.
	b.Run("ours_retry_removing", func(b *testing.B) { runMeshAdd(b, dir, []int{22, 3306, 5432}, []int{22}) })
	// The same retry with the same divert (the pin is replaced, the
	// divert is not touched): what a retry costs besides the divert.
	b.Run("ours_retry_same", func(b *testing.B) { runMeshAdd(b, dir, []int{22}, []int{22}) })

	b.Run("peer", func(b *testing.B) {
		if _, err := exec.LookPath("nft"); err != nil {
			b.Fatalf("peer needs the nft binary: %v", err)
		}
		sock := filepath.Join(dir, "istio.sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			b.Fatal(err)
		}
		hsrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			var ev struct {
				Netns string `json:"netns"`
			}
			if err := json.NewDecoder(r.Body).Decode(&ev); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			ns, err := cnins.GetNS(ev.Netns)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			defer ns.Close()
			err = ns.Do(func(cnins.NetNS) error {
				cmd := exec.Command("nft", "-f", "-")
				cmd.Stdin = strings.NewReader(capturetest.IstioInPodRuleset)
				var stderr bytes.Buffer
				cmd.Stderr = &stderr
				if err := cmd.Run(); err != nil {
					return fmt.Errorf("nft -f: %w: %s", err, stderr.String())
				}
				return nil
			})
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
			}
		})}
		go hsrv.Serve(l)
		defer hsrv.Close()
		var lat capturetest.Latencies
		b.ResetTimer()
		for i := range b.N {
			b.StopTimer()
			ns, err := harness.CreateNS("bench")
			if err != nil {
				b.Fatal(err)
			}
			body, _ := json.Marshal(map[string]any{
				"netns": ns.Path(), "podName": "p", "podNamespace": "bench", "containerID": fmt.Sprintf("c%d", i),
				"ips": []string{"10.1.0.5", "fd10::5"},
			})
			b.StartTimer()
			start := time.Now()
			// A fresh client per ADD, as a freshly exec'd plugin has.
			client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", sock)
			}}}
			resp, err := client.Post("http://istio-cni/cmdadd", "application/json", bytes.NewReader(body))
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = fmt.Errorf("peer answered %s", resp.Status)
				}
			}
			lat = append(lat, time.Since(start))
			b.StopTimer()
			client.CloseIdleConnections()
			_ = ns.Remove()
			if err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
		lat.Report(b)
	})
}

// benchMeshExec times one CNI verb of whole plugin processes exec'd through
// libcni as containerd does, each pod in a fresh netns:
//
//   - ours: the release aether-cni binary (stripped, as `make build`
//     builds it) against a warm in-process agent on a unix socket, readiness
//     probe and CRI lookup off, netns pin on (unpinned at once on DEL);
//   - peer: the exec floor, a do-nothing Go plugin on skel
//     (testdata/floor-cni, built the same way) that prints prevResult.
//
// Both are the only plugin of their conflist, with the primary plugin's
// result inlined as prevResult; harness.ExecBench runs their ops
// interleaved, one of each in turn.
func benchMeshExec(b *testing.B, verb harness.Verb) {
	harness.RequireRoot(b)
	side := func(bin string, conf map[string]any) harness.ExecSide {
		conf["prevResult"] = json.RawMessage(meshcnitest.PrevResult)
		ex := harness.NewRSSExec()
		rt := harness.NewRuntimeExec(b, nil, []string{filepath.Dir(bin)}, harness.ConfList(b, "bench", "1.0.0", conf), ex)
		return harness.ExecSide{RT: rt, Ex: ex, Bin: bin, Pod: func(netns string) harness.Pod {
			return harness.Pod{ContainerID: harness.ContainerID(), NetNS: netns, Name: "p", Namespace: "bench", UID: "u"}
		}}
	}
	dir := b.TempDir()
	ours := side(harness.BuildRelease(b, "./cmd/aether-cni"), map[string]any{
		"type": "aether-cni", "agent_socket": meshcnitest.ServeAgent(b, dir),
		"netns_pin_dir": filepath.Join(dir, "pins"), "netns_unpin_delay_seconds": 0, "cri_socket": "",
		"readiness_probe_disabled": true,
		"capture":                  map[string]any{"redirect_all": true, "exclude_ports": []int{22}},
	})
	peer := side(harness.BuildRelease(b, "./meshcni/testdata/floor-cni"), map[string]any{"type": "floor-cni"})
	harness.ExecBench(b, verb, ours, peer)
}

// BenchmarkMeshExecAdd: aether-cni's whole-process ADD vs the exec floor of
// a Go CNI plugin (see benchMeshExec); issue 15.
func BenchmarkMeshExecAdd(b *testing.B) { benchMeshExec(b, harness.VerbAdd) }

// BenchmarkMeshExecDel: aether-cni's whole-process DEL vs the exec floor
// (see benchMeshExec); issue 15.
func BenchmarkMeshExecDel(b *testing.B) { benchMeshExec(b, harness.VerbDel) }

// runMeshAdd measures meshcni.Plugin.Add of a pod whose divert excludes
// ports, in a fresh pod netns per op; with first set, an ADD of the same
// sandbox excluding first runs before, outside the measurement (a retry).
// The plugin is meshcni.New's, with a socket closer that counts its starts
// (capturetest.Closer), ended and reaped after each op.
func runMeshAdd(b *testing.B, dir string, first, ports []int) {
	sock := meshcnitest.ServeAgent(b, dir)
	pinDir := filepath.Join(dir, "pins")
	stdin := func(ports []int) []byte {
		in, _ := json.Marshal(map[string]any{
			"cniVersion": "1.0.0", "name": "bench", "type": "aether-cni", "agent_socket": sock,
			"netns_pin_dir": pinDir, "netns_unpin_delay_seconds": 0, "cri_socket": "",
			"readiness_probe_disabled": true,
			"capture":                  map[string]any{"redirect_all": true, "exclude_ports": ports},
			"prevResult":               json.RawMessage(meshcnitest.PrevResult),
		})
		return in
	}
	plugin := func() (*meshcni.Plugin, *capturetest.Closer) {
		p := meshcni.New(time.Now())
		p.Stdout, p.Stderr = io.Discard, io.Discard
		cl := capturetest.NewCloser(0)
		p.Capture = capture.Installer{Closer: cl}
		return p, cl
	}
	var lat capturetest.Latencies
	b.ResetTimer()
	for i := range b.N {
		// One op; its netns and pin go whatever happens (b.Fatal runs
		// the deferred calls).
		func() {
			b.StopTimer()
			ns, err := harness.CreateNS("bench")
			if err != nil {
				b.Fatal(err)
			}
			args := func(ports []int) *skel.CmdArgs {
				return &skel.CmdArgs{
					ContainerID: fmt.Sprintf("c%d", i), Netns: ns.Path(), IfName: "eth0", StdinData: stdin(ports),
					Args: "K8S_POD_NAME=p;K8S_POD_NAMESPACE=bench;K8S_POD_INFRA_CONTAINER_ID=" + fmt.Sprintf("c%d", i),
				}
			}
			a := args(ports)
			defer func() {
				_ = pin.Unpin(pin.Path(pinDir, a.ContainerID))
				_ = ns.Remove()
			}()
			if first != nil {
				p, cl := plugin()
				err := p.Add(args(first))
				cl.End(b)
				if err != nil {
					b.Fatal(err)
				}
			}
			p, cl := plugin()
			b.StartTimer()
			start := time.Now()
			p.Started = start
			err = p.Add(a)
			lat = append(lat, time.Since(start))
			b.StopTimer()
			cl.End(b)
			if err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}()
	}
	lat.Report(b)
}
