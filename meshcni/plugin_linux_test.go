package meshcni

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/api/aether/cni/v1/cniv1grpc"
	"aether.io/node/meshcni/agentclient"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/cniutil"
)

// recorder is every fake at once; it logs calls in order.
type recorder struct {
	calls     []string
	addResult agentclient.AddResult
	addErr    error
	removeErr error
	added     *agentclient.Pod
	// addTimings and removeTimings are the plugin_timings of the last
	// AddPod and RemovePod.
	addTimings, removeTimings *agentclient.Timings
	report                    *agentclient.ReportRequest
	installErr                error
	probeErr                  error
	verifyErr                 error
	present                   bool
	record                    *agentclient.Record
	pins                      map[string]bool
	pidErr                    error
}

func (r *recorder) log(f string, a ...any) { r.calls = append(r.calls, fmt.Sprintf(f, a...)) }

func (r *recorder) AddPod(_ context.Context, req *agentclient.AddPodRequest) (agentclient.AddResult, error) {
	r.log("AddPod")
	r.added, r.addTimings = req.Pod, req.PluginTimings
	return r.addResult, r.addErr
}

func (r *recorder) RemovePod(_ context.Context, req *agentclient.RemovePodRequest) (agentclient.RemoveResult, error) {
	r.log("RemovePod %s/%s %s", req.Namespace, req.Name, req.ContainerID)
	r.removeTimings = req.PluginTimings
	return agentclient.RemoveSuccess, r.removeErr
}

func (r *recorder) ReportAddResult(_ context.Context, req *agentclient.ReportRequest) error {
	r.log("Report")
	r.report = req
	return nil
}

func (r *recorder) GetPod(_ context.Context, cid string) (*agentclient.Record, error) {
	r.log("GetPod")
	if r.record == nil {
		return nil, agentclient.ErrNotFound
	}
	return r.record, nil
}
func (r *recorder) Ready(context.Context) error { return r.removeErr }
func (r *recorder) Connect()                    {}
func (r *recorder) Close() error                { return nil }

func (r *recorder) Install(ns string, _ capture.Ruleset) error {
	r.log("Install %s", ns)
	return r.installErr
}

func (r *recorder) Verify(string, capture.Ruleset) error { r.log("Verify"); return r.verifyErr }
func (r *recorder) Present(string) (bool, error)         { return r.present, nil }
func (r *recorder) Remove(ns string, _ capture.Config) error {
	r.log("Remove %s", ns)
	return nil
}

func (r *recorder) Pin(dir, cid, ns string) (string, error) {
	r.log("Pin")
	r.pins[cid] = true
	return filepath.Join(dir, cid), nil
}
func (r *recorder) Path(dir, cid string) string { return filepath.Join(dir, cid) }
func (r *recorder) Unpin(p string) error {
	r.log("Unpin")
	delete(r.pins, filepath.Base(p))
	return nil
}

func (r *recorder) UnpinLater(p string, _ time.Duration) error { return r.Unpin(p) }
func (r *recorder) List(string) ([]string, error) {
	var out []string
	for k := range r.pins {
		out = append(out, k)
	}
	slices.Sort(out)
	return out, nil
}
func (r *recorder) Name(cid string) string { return cid }

func (r *recorder) Probe(_ context.Context, ns, url string, _ time.Duration) error {
	r.log("Probe %s", url)
	return r.probeErr
}

func (r *recorder) Lookup(context.Context, string, string) (uint32, error) {
	r.log("CRI")
	return 99, r.pidErr
}

func newTestPlugin(r *recorder) (*Plugin, *bytes.Buffer) {
	out := &bytes.Buffer{}
	clock := time.Unix(1000, 0)
	return &Plugin{
		Started:   clock,
		Now:       func() time.Time { clock = clock.Add(time.Millisecond); return clock },
		DialAgent: func(*Config) (Agent, error) { return r, nil },
		Capture:   r, Pins: r, Readiness: r, PIDs: r,
		Stdout: out, Stderr: io.Discard,
	}, out
}

func conf(extra string) []byte {
	return []byte(`{"cniVersion":"1.0.0","name":"n","type":"aether-cni","netns_pin_dir":"/pins",` + extra + prev + `}`)
}

func args(netns string, stdin []byte) *skel.CmdArgs {
	return &skel.CmdArgs{
		ContainerID: "cid", Netns: netns, IfName: "eth0", StdinData: stdin,
		Args: "K8S_POD_INFRA_CONTAINER_ID=sandbox;IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=shop",
	}
}

func TestAddManagedOrderAndTimings(t *testing.T) {
	r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}}
	p, out := newTestPlugin(r)
	if err := p.Add(args("/run/netns/pod", conf(""))); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), `"10.1.0.5/24"`) {
		t.Fatalf("prevResult not passed through: %s", out)
	}
	want := []string{"CRI", "Pin", "AddPod", "Probe http://127.0.0.1:18081/aether/readyz", "Install /run/netns/pod", "Report"}
	if !slices.Equal(r.calls, want) {
		t.Fatalf("calls = %q, want %q", r.calls, want)
	}
	if r.added.ContainerID != "sandbox" || r.added.NetworkNamespace != "/pins/cid" ||
		!slices.Equal(r.added.IPs, []string{"10.1.0.5"}) || r.added.PID == nil || *r.added.PID != 99 {
		t.Fatalf("AddPod got %v", r.added)
	}
	tm := r.report.Timings
	if tm == nil || tm.Started == nil || tm.PreCall == nil || tm.ReadinessProbe == nil || tm.CaptureDivert == nil || tm.Total == nil {
		t.Fatalf("timings incomplete: %v", tm)
	}
	if tm.ReadinessProbeError != "" || tm.CaptureDivertError != "" {
		t.Fatalf("unexpected errors in timings: %v", tm)
	}
	if tm.Total.AsDuration() <= tm.PreCall.AsDuration() {
		t.Fatalf("total %v not after pre_call %v", tm.Total.AsDuration(), tm.PreCall.AsDuration())
	}
	// AddPod carried started and pre_call (the same as the report's), and
	// nothing AddPod could not know yet.
	wantT := &agentclient.Timings{Started: agentclient.NewTimestamp(time.Unix(1000, 0)), PreCall: tm.PreCall}
	if !reflect.DeepEqual(r.addTimings, wantT) || tm.PreCall.AsDuration() <= 0 {
		t.Fatalf("AddPod plugin_timings = %v, want %v", r.addTimings, wantT)
	}
}

func TestAddPidFromPathSkipsCRI(t *testing.T) {
	r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}}
	p, _ := newTestPlugin(r)
	if err := p.Add(args("/proc/4321/ns/net", conf(`"readiness_probe_disabled":true,`))); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(r.calls, "CRI") || r.added.PID == nil || *r.added.PID != 4321 {
		t.Fatalf("calls %q pid %v", r.calls, r.added.PID)
	}
	if r.report.Timings.ReadinessProbe != nil {
		t.Fatal("readiness_probe set although the probe is disabled")
	}
}

func TestAddCRIFailureIsNormal(t *testing.T) {
	r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}, pidErr: errors.New("sandbox not found")}
	p, _ := newTestPlugin(r)
	if err := p.Add(args("/run/netns/pod", conf(""))); err != nil {
		t.Fatal(err)
	}
	if r.added.PID != nil {
		t.Fatalf("pid = %v, want unset", *r.added.PID)
	}
}

func TestAddIgnoredInstallsNothing(t *testing.T) {
	r := &recorder{addResult: agentclient.AddIgnored, pins: map[string]bool{}}
	p, out := newTestPlugin(r)
	if err := p.Add(args("/run/netns/pod", conf(""))); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), `"10.1.0.5/24"`) {
		t.Fatalf("prevResult not passed through: %s", out)
	}
	want := []string{"CRI", "Pin", "AddPod", "Unpin"}
	if !slices.Equal(r.calls, want) {
		t.Fatalf("calls = %q, want %q", r.calls, want)
	}
}

func TestAddDivertFailureFailOpen(t *testing.T) {
	r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}, installErr: errors.New("nft: no tproxy"), probeErr: errors.New("503")}
	p, _ := newTestPlugin(r)
	if err := p.Add(args("/run/netns/pod", conf(`"capture_failure":"open",`))); err != nil {
		t.Fatalf("ADD failed on a divert failure under capture_failure=open: %v", err)
	}
	tm := r.report.Timings
	if !strings.Contains(tm.CaptureDivertError, "no tproxy") || !strings.Contains(tm.ReadinessProbeError, "503") {
		t.Fatalf("errors not reported: %v", tm)
	}
	if !r.pins["cid"] || slices.ContainsFunc(r.calls, func(c string) bool { return strings.HasPrefix(c, "RemovePod") || c == "Remove" }) {
		t.Fatalf("capture_failure=open rolled back: calls %q, pins %v", r.calls, r.pins)
	}
}

// TestAddCaptureFailureFail: under capture_failure "fail" (the default) a
// readiness probe that never answers (code 11) or a divert that cannot be
// installed (code 999) fails the ADD after reporting the error, and the
// ADD leaves nothing: divert removed, agent record withdrawn, pin released,
// nothing printed.
func TestAddCaptureFailureFail(t *testing.T) {
	for _, tc := range []struct {
		name       string
		conf       string
		probeErr   error
		installErr error
		wantCode   uint
		wantCalls  []string
		wantReport func(*agentclient.Timings) bool
	}{
		{
			name: "probe never answers", probeErr: errors.New("connection refused"), wantCode: types.ErrTryAgainLater,
			wantCalls: []string{"CRI", "Pin", "AddPod", "Probe http://127.0.0.1:18081/aether/readyz", "Report", "Remove /run/netns/pod", "RemovePod shop/web sandbox", "Unpin"},
			wantReport: func(tm *agentclient.Timings) bool {
				return strings.Contains(tm.ReadinessProbeError, "refused") && tm.CaptureDivert == nil
			},
		},
		{
			name: "divert fails (explicit fail)", conf: `"capture_failure":"fail",`, installErr: errors.New("nft: no tproxy"), wantCode: types.ErrInternal,
			wantCalls:  []string{"CRI", "Pin", "AddPod", "Probe http://127.0.0.1:18081/aether/readyz", "Install /run/netns/pod", "Report", "Remove /run/netns/pod", "RemovePod shop/web sandbox", "Unpin"},
			wantReport: func(tm *agentclient.Timings) bool { return strings.Contains(tm.CaptureDivertError, "no tproxy") },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}, installErr: tc.installErr, probeErr: tc.probeErr}
			p, out := newTestPlugin(r)
			err := p.Add(args("/run/netns/pod", conf(tc.conf)))
			ce := cniutil.AsCNIError(err)
			if ce == nil || ce.Code != tc.wantCode || !strings.Contains(err.Error(), "capture_failure") {
				t.Fatalf("ADD = %v, want code %d naming capture_failure", err, tc.wantCode)
			}
			if !slices.Equal(r.calls, tc.wantCalls) {
				t.Fatalf("calls = %q, want %q", r.calls, tc.wantCalls)
			}
			if r.report == nil || !tc.wantReport(r.report.Timings) {
				t.Fatalf("report = %+v", r.report)
			}
			if len(r.pins) != 0 || out.Len() != 0 {
				t.Fatalf("failed ADD left pins %v, printed %q", r.pins, out)
			}
		})
	}
}

func TestAddAgentErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		res      agentclient.AddResult
		err      error
		wantCode uint
	}{
		{"unavailable", 0, fmt.Errorf("%w: down", agentclient.ErrUnavailable), types.ErrTryAgainLater},
		{"rpc error", 0, errors.New("InvalidArgument"), types.ErrInternal},
		{"result error", agentclient.AddError, nil, types.ErrInternal},
		{"result unspecified", agentclient.AddUnspecified, nil, types.ErrInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{addResult: tc.res, addErr: tc.err, pins: map[string]bool{}}
			p, _ := newTestPlugin(r)
			err := p.Add(args("/run/netns/pod", conf("")))
			if got := cniutil.AsCNIError(err); got == nil || got.Code != tc.wantCode {
				t.Fatalf("ADD = %v, want code %d", err, tc.wantCode)
			}
			if len(r.pins) != 0 {
				t.Fatal("pin left after a failed ADD")
			}
		})
	}
}

func TestAddNeedsIdentityAndPrev(t *testing.T) {
	r := &recorder{pins: map[string]bool{}}
	p, _ := newTestPlugin(r)
	a := args("/run/netns/pod", conf(""))
	a.Args = "IgnoreUnknown=1"
	if err := p.Add(a); cniutil.AsCNIError(err).Code != 7 {
		t.Fatalf("ADD without pod name = %v, want code 7", err)
	}
	a = args("/run/netns/pod", []byte(`{"cniVersion":"1.0.0","name":"n","type":"aether-cni"}`))
	if err := p.Add(a); cniutil.AsCNIError(err).Code != 7 || !strings.Contains(err.Error(), "chained") {
		t.Fatalf("ADD without prevResult = %v", err)
	}
	if len(r.calls) != 0 {
		t.Fatalf("calls made on a bad ADD: %q", r.calls)
	}
}

func TestDel(t *testing.T) {
	r := &recorder{pins: map[string]bool{}}
	p, _ := newTestPlugin(r)
	a := args("", conf(""))
	a.Args = "K8S_POD_NAME=web;K8S_POD_NAMESPACE=shop" // no infra ID: falls back to CNI_CONTAINERID
	if err := p.Del(a); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r.calls, []string{"RemovePod shop/web cid"}) {
		t.Fatalf("calls = %q", r.calls)
	}
	// The test clock ticks 1ms per reading: started -> RemovePod sent.
	want := &agentclient.Timings{Started: agentclient.NewTimestamp(time.Unix(1000, 0)), PreCall: agentclient.NewDuration(time.Millisecond)}
	if !reflect.DeepEqual(r.removeTimings, want) {
		t.Fatalf("RemovePod plugin_timings = %v, want %v", r.removeTimings, want)
	}
	r.removeErr = fmt.Errorf("%w: down", agentclient.ErrUnavailable)
	err := p.Del(a)
	if got := cniutil.AsCNIError(err); got == nil || got.Code != 11 || !strings.Contains(got.Msg, "aether-agent") {
		t.Fatalf("DEL with the agent down = %v, want code 11 naming the agent", err)
	}
}

func TestCheck(t *testing.T) {
	rec := &agentclient.Record{Managed: true, Pod: &agentclient.Pod{
		Name: "web", Namespace: "shop", ContainerID: "sandbox", NetworkNamespace: "/pins/cid", IPs: []string{"10.1.0.5"},
	}}
	for _, tc := range []struct {
		name    string
		r       recorder
		wantErr string
	}{
		{"managed and intact", recorder{record: rec}, ""},
		{"managed, rules changed", recorder{record: rec, verifyErr: errors.New("chain divert has 3 rules, want 4")}, "differs from what ADD installs"},
		{"not managed, no table", recorder{}, ""},
		{"not managed but table present", recorder{present: true}, "not mesh-managed"},
		{"record of another pod", recorder{record: &agentclient.Record{Managed: true, Pod: &agentclient.Pod{Name: "x", Namespace: "shop"}}}, "want shop/web"},
		{"record with other IPs", recorder{record: &agentclient.Record{Managed: true, Pod: &agentclient.Pod{Name: "web", Namespace: "shop", NetworkNamespace: "/pins/cid", IPs: []string{"10.1.0.6"}}}}, "IPs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.r
			r.pins = map[string]bool{}
			p, _ := newTestPlugin(&r)
			err := p.Check(args("/run/netns/pod", conf("")))
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("CHECK = %v, want %q", err, tc.wantErr)
			}
		})
	}
}

func TestGC(t *testing.T) {
	r := &recorder{pins: map[string]bool{"keep": true, "stale1": true, "stale2": true}}
	p, _ := newTestPlugin(r)
	stdin, _ := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "n", "type": "aether-cni", "netns_pin_dir": "/pins",
		"cni.dev/valid-attachments": []map[string]string{{"containerID": "keep", "ifname": "eth0"}},
	})
	if err := p.GC(&skel.CmdArgs{StdinData: stdin}); err != nil {
		t.Fatal(err)
	}
	if left, _ := r.List(""); !slices.Equal(left, []string{"keep"}) {
		t.Fatalf("pins after GC = %v", left)
	}
}

// TestPreamble checks the one preamble of ADD, DEL and CHECK: what each
// verb requires from its invocation, and that a rejected call reaches no
// dependency.
func TestPreamble(t *testing.T) {
	noPrev := []byte(`{"cniVersion":"1.0.0","name":"n","type":"aether-cni","netns_pin_dir":"/pins"}`)
	tests := []struct {
		name    string
		mutate  func(a *skel.CmdArgs)
		wantErr map[string]string // verb → message part; absent: accepted
	}{
		{"complete", func(*skel.CmdArgs) {}, nil},
		{"no prevResult", func(a *skel.CmdArgs) { a.StdinData = noPrev }, map[string]string{"ADD": "chained", "CHECK": "chained"}},
		{"no pod identity", func(a *skel.CmdArgs) { a.Args = "IgnoreUnknown=1" }, map[string]string{"ADD": "K8S_POD_NAME", "CHECK": "K8S_POD_NAME"}},
		{"bad CNI_ARGS", func(a *skel.CmdArgs) { a.Args = "bare" }, map[string]string{"ADD": "CNI_ARGS", "DEL": "CNI_ARGS", "CHECK": "CNI_ARGS"}},
		{"empty netns", func(a *skel.CmdArgs) { a.Netns = "" }, map[string]string{"ADD": "ADD needs the pod's network namespace", "CHECK": "CHECK needs the pod's network namespace"}},
	}
	p, _ := newTestPlugin(&recorder{pins: map[string]bool{}})
	for _, tt := range tests {
		for _, v := range []verb{verbAdd, verbDel, verbCheck} {
			t.Run(tt.name+"/"+v.name, func(t *testing.T) {
				a := args("/run/netns/pod", conf(""))
				tt.mutate(a)
				c, err := p.begin(a, v)
				want, fails := tt.wantErr[v.name]
				if !fails {
					if err != nil {
						t.Fatalf("begin = %v, want success", err)
					}
					c.closeLog()
					if c.id.sandboxID == "" || c.cfg == nil {
						t.Errorf("call = %+v, want sandbox ID and netconf", c)
					}
					return
				}
				if ce := cniutil.AsCNIError(err); ce == nil || ce.Code != 7 || !strings.Contains(ce.Msg, want) {
					t.Errorf("begin = %v, want code 7 naming %q", err, want)
				}
			})
		}
	}
}

// TestAddForwardsPodUID: K8S_POD_UID (containerd passes it) reaches the
// AddPod request so the agent can refuse a lagging pod source's old pod;
// a runtime that does not pass it sends no uid.
func TestAddForwardsPodUID(t *testing.T) {
	for _, tc := range []struct {
		name, extraArgs, want string
	}{
		{"K8S_POD_UID given", ";K8S_POD_UID=3f1c2d4e-0000-4000-8000-000000000001", "3f1c2d4e-0000-4000-8000-000000000001"},
		{"no K8S_POD_UID", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{addResult: agentclient.AddSuccess, pins: map[string]bool{}}
			p, _ := newTestPlugin(r)
			a := args("/run/netns/pod", conf(""))
			a.Args += tc.extraArgs
			if err := p.Add(a); err != nil {
				t.Fatal(err)
			}
			if got := r.added.UID; got != tc.want {
				t.Fatalf("AddPod uid = %q, want %q", got, tc.want)
			}
		})
	}
}

// timingsAgent is a CNIService over a unix socket that records the
// plugin_timings of every AddPod, RemovePod and ReportAddResult.
type timingsAgent struct {
	cniv1grpc.UnimplementedCNIServiceServer
	mu                        sync.Mutex
	add, remove, report       *cniv1.PluginTimings
	addSeen, removeSeen, seen bool
}

func (a *timingsAgent) AddPod(_ context.Context, req *cniv1.AddPodRequest) (*cniv1.AddPodResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.add, a.addSeen = req.GetPluginTimings(), true
	return &cniv1.AddPodResponse{Result: cniv1.AddPodResponse_RESULT_SUCCESS}, nil
}

func (a *timingsAgent) RemovePod(_ context.Context, req *cniv1.RemovePodRequest) (*cniv1.RemovePodResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.remove, a.removeSeen = req.GetPluginTimings(), true
	return &cniv1.RemovePodResponse{Result: cniv1.RemovePodResponse_RESULT_SUCCESS}, nil
}

func (a *timingsAgent) ReportAddResult(_ context.Context, req *cniv1.ReportAddResultRequest) (*cniv1.ReportAddResultResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.report, a.seen = req.GetTimings(), true
	return &cniv1.ReportAddResultResponse{}, nil
}

// TestTimingsOnEveryRPC runs ADD and DEL through the real agent client to a
// CNIService on a unix socket: AddPod and RemovePod carry the invocation's
// started and pre_call on the wire, and AddPod's are the report's.
func TestTimingsOnEveryRPC(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "cni.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	agent := &timingsAgent{}
	srv := grpc.NewServer()
	cniv1grpc.RegisterCNIServiceServer(srv, agent)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Stop(); <-done })

	r := &recorder{pins: map[string]bool{}}
	p, _ := newTestPlugin(r)
	p.DialAgent = DialAgent
	stdin := conf(`"agent_socket":"` + sock + `","readiness_probe_disabled":true,`)
	if err := p.Add(args("/run/netns/pod", stdin)); err != nil {
		t.Fatal(err)
	}
	if err := p.Del(args("/run/netns/pod", stdin)); err != nil {
		t.Fatal(err)
	}
	agent.mu.Lock()
	defer agent.mu.Unlock()
	if !agent.addSeen || !agent.removeSeen || !agent.seen {
		t.Fatalf("RPCs seen: AddPod %v, RemovePod %v, ReportAddResult %v", agent.addSeen, agent.removeSeen, agent.seen)
	}
	started := timestamppb.New(time.Unix(1000, 0))
	for _, tc := range []struct {
		rpc string
		got *cniv1.PluginTimings
	}{{"AddPod", agent.add}, {"RemovePod", agent.remove}} {
		if !proto.Equal(tc.got.GetStarted(), started) || tc.got.GetPreCall().AsDuration() <= 0 {
			t.Errorf("%s plugin_timings = %v, want started %v and a pre_call", tc.rpc, tc.got, started.AsTime())
		}
		if tc.got.GetTotal() != nil || tc.got.GetCaptureDivert() != nil || tc.got.GetReadinessProbe() != nil {
			t.Errorf("%s plugin_timings = %v, want started and pre_call only", tc.rpc, tc.got)
		}
	}
	if !proto.Equal(agent.add.GetPreCall(), agent.report.GetPreCall()) || !proto.Equal(agent.add.GetStarted(), agent.report.GetStarted()) {
		t.Errorf("AddPod timings %v differ from the report's %v", agent.add, agent.report)
	}
}
