package meshcni

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"aether.io/node/pkg/cniutil"
)

const prev = `"prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}], "ips": [{"address": "10.1.0.5/24", "interface": 0}]}`

func TestParseConfig(t *testing.T) {
	for _, tc := range []struct {
		name, conf  string
		requirePrev bool
		wantErr     string // substring; "" = ok
	}{
		{"minimal", `{"cniVersion":"1.0.0","name":"n","type":"aether-cni",` + prev + `}`, true, ""},
		{"no prevResult on ADD", `{"cniVersion":"1.0.0","name":"n","type":"aether-cni"}`, true, "must be chained"},
		{"no prevResult on DEL", `{"cniVersion":"1.0.0","name":"n","type":"aether-cni"}`, false, ""},
		{"bad json", `{`, false, "failed to parse"},
		{"relative socket", `{"agent_socket":"run/x.sock"}`, false, "absolute path"},
		{"zero agent timeout", `{"agent_timeout_ms":0}`, false, "agent_timeout_ms 0: must be 1-30000"},
		{"too many attempts", `{"add_attempts":50}`, false, "add_attempts 50: must be 1-10"},
		{"bad cri socket", `{"cri_socket":"/run/containerd.sock"}`, false, "unix:///"},
		{"cri disabled", `{"cri_socket":""}`, false, ""},
		{"negative unpin delay", `{"netns_unpin_delay_seconds":-1}`, false, "must be 0-3600"},
		{"probe budget too big", `{"readiness_probe_budget_ms":600000}`, false, "readiness_probe_budget_ms"},
		{"probe disabled ignores budget", `{"readiness_probe_disabled":true,"readiness_probe_budget_ms":600000}`, false, ""},
		{"bad capture port", `{"capture":{"capture_port":70000}}`, false, "capture.capture_port 70000"},
		{"bad excluded cidr", `{"capture":{"exclude_cidrs":["10.0.0.0/33"]}}`, false, "capture.exclude_cidrs entry"},
		{"main route table", `{"capture":{"route_table":254}}`, false, "capture.route_table 254"},
		{"same marks", `{"capture":{"bypass_mark":5,"divert_mark":5}}`, false, "differ"},
		{"deliver mark is the divert mark", `{"capture":{"deliver_mark":44671}}`, false, "deliver mark 0xae7f must be non-zero and differ from the bypass mark 0xae7e and the divert mark 0xae7f"},
		{"deliver mark is the bypass mark", `{"capture":{"bypass_mark":7,"deliver_mark":7}}`, false, "deliver mark 0x7 must be non-zero and differ"},
		{"zero deliver mark", `{"capture":{"deliver_mark":0}}`, false, "capture.bypass_mark/divert_mark/deliver_mark 0"},
		{"custom deliver mark", `{"capture":{"deliver_mark":44669}}`, false, ""},
		{"bad log level", `{"log_level":"loud"}`, false, "log_level"},
		{"capture_failure open", `{"capture_failure":"open"}`, false, ""},
		{"bad capture_failure", `{"capture_failure":"ignore"}`, false, `invalid capture_failure "ignore": must be "fail"`},
		{"inbound capture", `{"capture":{"inbound_capture":true,"exclude_inbound_ports":[9090],"inbound_plaintext_allow_cidrs":["192.0.2.10","fd00::/64"]}}`, false, ""},
		{"bad inbound port", `{"capture":{"inbound_port":0}}`, false, "capture.inbound_port 0"},
		{"hbone port", `{"capture":{"hbone_port":15009}}`, false, ""},
		{"bad hbone port", `{"capture":{"hbone_port":70000}}`, false, "capture.hbone_port 70000"},
		{"inbound port is the capture port", `{"capture":{"inbound_capture":true,"inbound_port":18001}}`, false, "inbound port 18001 must differ"},
		{"bad excluded inbound port", `{"capture":{"exclude_inbound_ports":[0]}}`, false, "capture.exclude_inbound_ports entry 0"},
		{"bad allowed source", `{"capture":{"inbound_plaintext_allow_cidrs":["node"]}}`, false, "capture.inbound_plaintext_allow_cidrs entry \"node\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tc.conf), tc.requirePrev)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("ParseConfig = %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("ParseConfig = %v, want error containing %q", err, tc.wantErr)
			}
			if !errors.Is(err, cniutil.ErrInvalidConfig) || cniutil.AsCNIError(err).Code != 7 {
				t.Fatalf("error %v is not code 7", err)
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{}`), false)
	if err != nil {
		t.Fatal(err)
	}
	if c.AgentSocket != DefaultAgentSocket || c.PinDir != DefaultPinDir || c.UnpinDelay != DefaultUnpinDelay ||
		c.ProbeBudget != DefaultProbeBudget || c.ProbeURL != "http://127.0.0.1:18081/aether/readyz" ||
		c.CRISocket != DefaultCRISocket || c.AddAttempts != 3 || c.FailOpen {
		t.Fatalf("defaults: %+v", c)
	}
	if !slices.Equal(c.Capture.Ports, []uint16{18081}) || c.Capture.RedirectAll || c.Capture.CapturePort != 18001 {
		t.Fatalf("capture defaults: %+v", c.Capture)
	}
	// The inbound redirect is off by default (compatibility: see README).
	if c.Capture.InboundCapture || c.Capture.InboundPort != 18008 || len(c.Capture.InboundAllowCIDRs) != 0 {
		t.Fatalf("inbound defaults: %+v", c.Capture)
	}
}

// TestPodInboundCapture: the netconf turns the inbound redirect on for
// every pod; a pod whose policy annotation is anything but permissive gets
// it anyway (strict, or an invalid value the agent serves as strict); the
// exclude-inbound-ports annotation adds to the netconf's list.
func TestPodInboundCapture(t *testing.T) {
	off, err := ParseConfig([]byte(`{}`), false)
	if err != nil {
		t.Fatal(err)
	}
	on, err := ParseConfig([]byte(`{"capture":{"inbound_capture":true,"exclude_inbound_ports":[22],"inbound_plaintext_allow_cidrs":["192.0.2.10"]}}`), false)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		c      *Config
		policy string // "" = no annotation
		want   bool
	}{
		{"netconf off", off, "", false},
		{"netconf off, permissive", off, "permissive", false},
		{"netconf off, strict", off, "strict", true},
		{"netconf off, invalid", off, "strcit", true},
		{"netconf on", on, "", true},
		{"netconf on, permissive", on, "permissive", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ann := map[string]string{}
			if tc.policy != "" {
				ann[AnnotationInboundPolicy] = tc.policy
			}
			pc, _ := tc.c.PodCapture(ann)
			if pc.InboundCapture != tc.want {
				t.Errorf("inbound capture = %v, want %v", pc.InboundCapture, tc.want)
			}
		})
	}
	pc, warns := on.PodCapture(map[string]string{AnnotationExcludeInboundPorts: "9090, x"})
	if !slices.Equal(pc.ExcludeInboundPorts, []uint16{22, 9090}) || len(warns) != 1 {
		t.Errorf("exclude inbound ports = %v, warnings %q; want [22 9090] and one warning", pc.ExcludeInboundPorts, warns)
	}
	if !slices.Equal(pc.InboundAllowCIDRs, []netip.Prefix{netip.MustParsePrefix("192.0.2.10/32")}) {
		t.Errorf("allowed sources = %v", pc.InboundAllowCIDRs)
	}
	if len(on.Capture.ExcludeInboundPorts) != 1 {
		t.Errorf("node config mutated: %+v", on.Capture)
	}
}

func TestPodCaptureAnnotations(t *testing.T) {
	c, err := ParseConfig([]byte(`{"capture":{"exclude_ports":[22],"exclude_cidrs":["10.96.0.0/12"]}}`), false)
	if err != nil {
		t.Fatal(err)
	}
	pc, warns := c.PodCapture(map[string]string{
		AnnotationRedirectAll:  "true",
		AnnotationExcludePorts: "3306, x, 22,70000",
		AnnotationExcludeCIDRs: "192.0.2.1, fd00::/8,nope",
	})
	if !pc.RedirectAll {
		t.Error("redirect-all annotation not applied")
	}
	if !slices.Equal(pc.ExcludePorts, []uint16{22, 3306}) {
		t.Errorf("exclude ports = %v", pc.ExcludePorts)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("192.0.2.1/32"), netip.MustParsePrefix("fd00::/8")}
	if !slices.Equal(pc.ExcludeCIDRs, want) {
		t.Errorf("exclude cidrs = %v, want %v", pc.ExcludeCIDRs, want)
	}
	if len(warns) != 3 {
		t.Errorf("warnings = %q, want 3 (x, 70000, nope)", warns)
	}
	// The node configuration is not changed by a pod's annotations.
	if c.Capture.RedirectAll || len(c.Capture.ExcludePorts) != 1 {
		t.Errorf("node config mutated: %+v", c.Capture)
	}
	off, _ := c.PodCapture(map[string]string{AnnotationRedirectAll: "false"})
	if off.RedirectAll || !slices.Equal(off.Ports, []uint16{18081}) {
		t.Errorf("redirect-all=false: %+v", off)
	}
}
