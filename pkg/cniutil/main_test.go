package cniutil

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

func TestFuncsMapsErrors(t *testing.T) {
	tests := []struct {
		name string
		err  error
		code uint // 0: no error
	}{
		{"success", nil, 0},
		{"invalid config", InvalidConfigf("invalid %q", "mtu"), types.ErrInvalidNetworkConfig},
		{"try again", TryAgainf("agent down: %w", errors.New("refused")), types.ErrTryAgainLater},
		{"typed error kept", &types.Error{Code: types.ErrInvalidEnvironmentVariables, Msg: "no pod"}, types.ErrInvalidEnvironmentVariables},
		{"anything else", fmt.Errorf("failed to add link %q: %w", "eth1", errors.New("boom")), types.ErrInternal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			verb := func(*skel.CmdArgs) error { return tt.err }
			f := Funcs(Verbs{Add: verb, Del: verb, Check: verb, Status: verb, GC: verb})
			for name, cb := range map[string]func(*skel.CmdArgs) error{"ADD": f.Add, "DEL": f.Del, "CHECK": f.Check, "STATUS": f.Status, "GC": f.GC} {
				err := cb(&skel.CmdArgs{})
				if tt.code == 0 {
					if err != nil {
						t.Errorf("%s = %v, want nil", name, err)
					}
					continue
				}
				var te *types.Error
				if !errors.As(err, &te) || te.Code != tt.code || te.Msg != tt.err.Error() {
					t.Errorf("%s = %#v, want code %d with message %q", name, err, tt.code, tt.err.Error())
				}
			}
		})
	}
}

func TestFuncsLeavesMissingVerbsNil(t *testing.T) {
	f := Funcs(Verbs{Add: func(*skel.CmdArgs) error { return nil }})
	if f.Add == nil || f.Del != nil || f.Check != nil || f.Status != nil || f.GC != nil {
		t.Errorf("Funcs = %+v, want only Add set", f)
	}
}

// runMain runs PluginMain with CNI_COMMAND=cmd and returns its exit code
// and what it printed to stdout.
func runMain(t *testing.T, cmd string, v Verbs) (int, []byte) {
	t.Helper()
	t.Setenv("CNI_COMMAND", cmd)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	t.Cleanup(func() { os.Stdout = stdout; _ = r.Close() })
	code := PluginMain(v, version.PluginSupports("1.0.0"), "test plugin", slog.New(slog.DiscardHandler))
	_ = w.Close()
	out, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return code, out
}

func TestPluginMainExitCodes(t *testing.T) {
	tests := []struct {
		name string
		cmd  string
		code int
		want string // a key the JSON on stdout must carry
	}{
		{"VERSION answers the plugin info", "VERSION", 0, "supportedVersions"},
		{"an unknown command prints the error", "BOGUS", 1, "code"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, out := runMain(t, tt.cmd, Verbs{Add: func(*skel.CmdArgs) error { return nil }})
			if code != tt.code {
				t.Errorf("exit code %d, want %d", code, tt.code)
			}
			var m map[string]any
			if err := json.Unmarshal(out, &m); err != nil {
				t.Fatalf("stdout %q: %v", out, err)
			}
			if _, ok := m[tt.want]; !ok {
				t.Errorf("stdout %s lacks %q", out, tt.want)
			}
		})
	}
}
