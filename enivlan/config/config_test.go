package config

import (
	"errors"
	"strings"
	"testing"

	"aether.io/node/pkg/cniutil"
)

func TestParse(t *testing.T) {
	base := `"cniVersion":"1.0.0","name":"eni","type":"eni-vlan"`
	tests := []struct {
		name    string
		in      string
		wantErr string // substring; "" means valid
		check   func(t *testing.T, c *NetConf)
	}{
		{
			name: "seed example", in: `{` + base + `,"master":"eth0","validateIaasNetConfig":true,"validationRetries":3,"validationTimeoutMs":500,"ipam":{"type":"spiderpool"}}`,
			check: func(t *testing.T, c *NetConf) {
				if !c.ValidateIaasNetConfig || c.ValidationRetries != 3 || c.ValidationTimeoutMs != 500 || c.Master != "eth0" || c.IPAMConf.Type != "spiderpool" {
					t.Errorf("got %+v", c)
				}
			},
		},
		{
			name: "defaults", in: `{` + base + `,"master":"eth0","ipam":{"type":"host-local"}}`,
			check: func(t *testing.T, c *NetConf) {
				if c.ValidateIaasNetConfig || c.ValidationRetries != DefaultValidationRetries || c.ValidationTimeoutMs != DefaultValidationTimeoutMs ||
					c.SpiderpoolSocket != DefaultSpiderpoolSocket || c.EndpointTimeoutMs != DefaultEndpointTimeoutMs || c.MTU != 0 || c.StateDir != DefaultStateDir {
					t.Errorf("defaults not applied: %+v", c)
				}
			},
		},
		{
			name: "ipam socket honoured", in: `{` + base + `,"master":"eth0","ipam":{"type":"spiderpool","ipam_unix_socket_path":"/run/x.sock"}}`,
			check: func(t *testing.T, c *NetConf) {
				if c.SpiderpoolSocket != "/run/x.sock" {
					t.Errorf("socket %q", c.SpiderpoolSocket)
				}
			},
		},
		{
			name: "explicit socket wins", in: `{` + base + `,"master":"eth0","spiderpoolSocket":"/a.sock","ipam":{"type":"spiderpool","ipam_unix_socket_path":"/run/x.sock"}}`,
			check: func(t *testing.T, c *NetConf) {
				if c.SpiderpoolSocket != "/a.sock" {
					t.Errorf("socket %q", c.SpiderpoolSocket)
				}
			},
		},
		{name: "vlanId rejected", in: `{` + base + `,"master":"eth0","vlanId":100,"ipam":{"type":"spiderpool"}}`, wantErr: `"vlanId" is not supported`},
		{name: "vlanMode rejected", in: `{` + base + `,"master":"eth0","vlanMode":"auto","ipam":{"type":"spiderpool"}}`, wantErr: `"vlanMode" is not supported`},
		{name: "master missing", in: `{` + base + `,"ipam":{"type":"spiderpool"}}`, wantErr: `"master" is required`},
		{name: "master too long", in: `{` + base + `,"master":"abcdefghijklmnop","ipam":{"type":"spiderpool"}}`, wantErr: `at most 15 bytes`},
		{name: "master wrong type", in: `{` + base + `,"master":7,"ipam":{"type":"spiderpool"}}`, wantErr: `invalid "master" 7`},
		{name: "mtu negative", in: `{` + base + `,"master":"eth0","mtu":-1,"ipam":{"type":"spiderpool"}}`, wantErr: `invalid "mtu" -1`},
		{name: "mtu tiny", in: `{` + base + `,"master":"eth0","mtu":10,"ipam":{"type":"spiderpool"}}`, wantErr: `68..65535`},
		{name: "mtu string", in: `{` + base + `,"master":"eth0","mtu":"1500","ipam":{"type":"spiderpool"}}`, wantErr: `invalid "mtu"`},
		{name: "retries zero", in: `{` + base + `,"master":"eth0","validationRetries":0,"ipam":{"type":"spiderpool"}}`, wantErr: `"validationRetries" 0: want 1..20`},
		{name: "retries huge", in: `{` + base + `,"master":"eth0","validationRetries":1000,"ipam":{"type":"spiderpool"}}`, wantErr: `"validationRetries" 1000`},
		{name: "timeout zero", in: `{` + base + `,"master":"eth0","validationTimeoutMs":0,"ipam":{"type":"spiderpool"}}`, wantErr: `"validationTimeoutMs" 0: want 1..10000`},
		{name: "timeout bool", in: `{` + base + `,"master":"eth0","validationTimeoutMs":true,"ipam":{"type":"spiderpool"}}`, wantErr: `invalid "validationTimeoutMs"`},
		{name: "validate not bool", in: `{` + base + `,"master":"eth0","validateIaasNetConfig":"yes","ipam":{"type":"spiderpool"}}`, wantErr: `invalid "validateIaasNetConfig"`},
		{name: "null means default", in: `{` + base + `,"master":"eth0","validationRetries":null,"ipam":{"type":"spiderpool"}}`, check: func(t *testing.T, c *NetConf) {
			if c.ValidationRetries != DefaultValidationRetries {
				t.Errorf("retries %d", c.ValidationRetries)
			}
		}},
		{name: "endpoint timeout", in: `{` + base + `,"master":"eth0","endpointTimeoutMs":100000,"ipam":{"type":"spiderpool"}}`, wantErr: `"endpointTimeoutMs" 100000`},
		{name: "ipam missing", in: `{` + base + `,"master":"eth0"}`, wantErr: `"ipam" is required`},
		{name: "ipam no type", in: `{` + base + `,"master":"eth0","ipam":{}}`, wantErr: `"ipam" is required`},
		{name: "not json", in: `{`, wantErr: `failed to parse network configuration`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.in))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				tt.check(t, c)
				return
			}
			if err == nil {
				t.Fatalf("want error containing %q, got %+v", tt.wantErr, c)
			}
			if !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q does not contain %q", err, tt.wantErr)
			}
			if !errors.Is(err, cniutil.ErrInvalidConfig) || cniutil.AsCNIError(err).Code != 7 {
				t.Errorf("error %q is not CNI code 7", err)
			}
		})
	}
}

func TestParseForDelIsLenient(t *testing.T) {
	// DEL must release IPAM even if the config would fail ADD validation.
	for _, in := range []string{
		`{"cniVersion":"1.0.0","name":"eni","type":"eni-vlan","vlanId":5,"ipam":{"type":"host-local"}}`,
		`{"cniVersion":"1.0.0","name":"eni","type":"eni-vlan","master":"eth0","validationRetries":0,"mtu":-4,"ipam":{"type":"host-local"}}`,
	} {
		if _, err := ParseForDel([]byte(in)); err != nil {
			t.Errorf("ParseForDel(%s): %v", in, err)
		}
	}
	if _, err := ParseForDel([]byte(`{"cniVersion":"1.0.0","name":"eni","type":"eni-vlan"}`)); err == nil {
		t.Error("ParseForDel without ipam: want error")
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"eni","type":"eni-vlan","master":"eth0","validateIaasNetConfig":true,"validationRetries":3,"validationTimeoutMs":500,"ipam":{"type":"spiderpool"}}`,
		`{"cniVersion":"1.1.0","name":"eni","type":"eni-vlan","master":"eth0","mtu":1400,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.0.0.0/24"}]]}}`,
		`{"master":"eth0","vlanId":100,"ipam":{"type":"spiderpool"}}`,
		`{"master":null}`, `[]`, `{"mtu":1e99}`, `{"validationRetries":-1,"ipam":{"type":"x"},"master":"e"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Parse(b)
		if err != nil {
			if cniutil.AsCNIError(err).Code != 7 {
				t.Fatalf("error not code 7: %v", err)
			}
			return
		}
		// Invariants of an accepted config.
		if c.Master == "" || len(c.Master) > 15 || c.IPAMConf.Type == "" ||
			c.ValidationRetries < 1 || c.ValidationRetries > MaxValidationRetries ||
			c.ValidationTimeoutMs < 1 || c.ValidationTimeoutMs > MaxValidationTimeoutMs ||
			c.MTU < 0 || (c.MTU > 0 && c.MTU < 68) || c.SpiderpoolSocket == "" {
			t.Fatalf("accepted an invalid config: %+v from %q", c, b)
		}
		if _, err := ParseForDel(b); err != nil {
			t.Fatalf("ParseForDel rejected what Parse accepted: %v", err)
		}
	})
}
