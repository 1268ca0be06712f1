package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"aether.io/node/pkg/adminapi"
)

// RunPods is `aetherctl pods`: every record the agent stores, with its
// state (managed, which label enrolled it and since when, terminating,
// registered, uncaptured, UDS socket).
// Flags: --admin-socket, -o table|json.
func RunPods(ctx context.Context, args []string, stdout io.Writer) error {
	f, pos, err := parseAdminFlags("aetherctl pods", args, stdout, nil)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return fmt.Errorf("unexpected arguments %q: aetherctl pods takes flags only", pos)
	}
	pods, err := adminapi.NewClient(f.socket).Pods(ctx)
	if err != nil {
		return err
	}
	if f.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(pods)
	}
	rows := [][]string{{"NAMESPACE", "NAME", "CONTAINER", "MANAGED", "ENROLLED", "SINCE", "TERMINATING", "REGISTERED", "UNCAPTURED", "IPS", "UDS"}}
	for _, p := range pods {
		rows = append(rows, []string{
			p.Namespace, p.Name, shortID(p.ContainerID), yesNo(p.Managed), enrolledBy(p), p.AddedAt.UTC().Format(time.RFC3339),
			yesNo(p.Terminating), yesNo(p.Registered), yesNo(p.Uncaptured), strings.Join(p.IPs, ","), udsColumn(p),
		})
	}
	writeTable(stdout, rows)
	return nil
}

// enrolledBy says which label enrolled p and when: at its CNI ADD (the
// agent decides there); "-" from an agent that does not say.
func enrolledBy(p adminapi.Pod) string {
	via := map[string]string{
		"pod_label": "pod label", "namespace_label": "namespace label", "namespace_ambient": "namespace ambient label",
	}[p.EnrolledVia]
	if via == "" {
		return dash(p.EnrolledVia)
	}
	return via + ", at ADD"
}
