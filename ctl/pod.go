package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"aether.io/node/agent/adminapi"
)

// RunPod is `aetherctl pod <namespace>/<name>`: every record of one pod
// in detail, including the last plugin timings. Flags: --admin-socket,
// -o table|json.
func RunPod(ctx context.Context, args []string, stdout io.Writer) error {
	f, fs, err := parseAdminFlags("aetherctl pod", args, stdout, nil)
	if err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("usage: aetherctl pod [flags] <namespace>/<name>")
	}
	ns, name, ok := strings.Cut(fs.Arg(0), "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return fmt.Errorf("invalid pod %q: want <namespace>/<name>", fs.Arg(0))
	}
	pods, err := adminapi.NewClient(f.socket).Pod(ctx, ns, name)
	if errors.Is(err, adminapi.ErrNotFound) {
		return fmt.Errorf("the agent has no record of pod %s/%s", ns, name)
	}
	if err != nil {
		return err
	}
	if f.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(pods)
	}
	for i, p := range pods {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		rows := [][]string{
			{"Pod:", p.Namespace + "/" + p.Name},
			{"Container:", p.ContainerID},
			{"UID:", p.UID},
			{"Service account:", p.ServiceAccount},
			{"IPs:", strings.Join(p.IPs, ", ")},
			{"Network namespace:", p.NetworkNS},
			{"Managed:", yesNo(p.Managed)},
			{"Terminating:", yesNo(p.Terminating)},
			{"Registered:", yesNo(p.Registered)},
			{"Healthy:", yesNo(p.Healthy)},
			{"Uncaptured:", yesNo(p.Uncaptured) + errSuffix(p.UncapturedError)},
			{"UDS socket:", udsColumn(p)},
			{"Volumes:", strings.Join(p.Volumes, ", ")},
			{"Added:", p.AddedAt.Format(time.RFC3339)},
		}
		var keys []string
		for k := range p.Labels {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			rows = append(rows, []string{"Label:", k + "=" + p.Labels[k]})
		}
		if len(p.LastTimings) == 0 {
			rows = append(rows, []string{"Last timings:", "none reported"})
		}
		for _, k := range []string{"started", "pre_call", "readiness_probe", "readiness_probe_error", "capture_divert", "capture_divert_error", "total"} {
			if v, ok := p.LastTimings[k]; ok {
				rows = append(rows, []string{"Last " + strings.ReplaceAll(k, "_", " ") + ":", v})
			}
		}
		writeTable(stdout, rows)
	}
	return nil
}

func errSuffix(e string) string {
	if e == "" {
		return ""
	}
	return " (" + e + ")"
}
