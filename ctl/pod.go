package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"aether.io/node/pkg/adminapi"
	"aether.io/node/pkg/meshcontract"
)

// RunPod is `aetherctl pod <namespace>/<name>`: every record of one pod
// in detail, including the plugin timings of its last ADD and, when the
// agent kept one, of its last DEL (also named when no record is left). Flags: --admin-socket,
// -o table|json.
func RunPod(ctx context.Context, args []string, stdout io.Writer) error {
	f, pos, err := parseAdminFlags("aetherctl pod", args, stdout, nil)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("usage: aetherctl pod [flags] <namespace>/<name>")
	}
	ns, name, ok := strings.Cut(pos[0], "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return fmt.Errorf("invalid pod %q: want <namespace>/<name>", pos[0])
	}
	pods, err := adminapi.NewClient(f.socket).Pod(ctx, ns, name)
	if errors.Is(err, adminapi.ErrNotFound) {
		var nf *adminapi.NotFoundError
		if errors.As(err, &nf) && nf.LastDel != nil {
			return fmt.Errorf("the agent has no record of pod %s/%s; its last DEL: %s", ns, name, delSummary(nf.LastDel))
		}
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
			{"Owner:", dash(p.Owner)},
			{"IPs:", strings.Join(p.IPs, ", ")},
			{"Network namespace:", p.NetworkNS},
			{"Managed:", yesNo(p.Managed)},
			{"Terminating:", yesNo(p.Terminating)},
			{"Registered:", yesNo(p.Registered)},
			{"Healthy:", yesNo(p.Healthy)},
			{"Uncaptured:", yesNo(p.Uncaptured) + errSuffix(p.UncapturedError)},
			{"UDS socket:", udsColumn(p)},
			{"Inbound policy:", inboundPolicy(p)},
			{"Declared ports:", declaredPorts(p)},
			{"Volumes:", strings.Join(p.Volumes, ", ")},
			{"Added:", p.AddedAt.Format(time.RFC3339)},
			{"Enrolled:", enrolledBy(p)},
		}
		if p.SPIFFEID != "" {
			// After the service account it names (identity on only).
			rows = slices.Insert(rows, 4, []string{"SPIFFE ID:", p.SPIFFEID})
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
		rows = append(rows, timingRows("Last ", p.LastTimings)...)
		if d := p.LastDel; d != nil {
			rows = append(rows, []string{"Last DEL:", delWhat(d)})
			rows = append(rows, timingRows("Last DEL ", d.Timings)...)
		}
		writeTable(stdout, rows)
	}
	return nil
}

// timingKeys are the admin API's timing keys in the order of an ADD.
var timingKeys = []string{"started", "pre_call", "readiness_probe", "readiness_probe_error", "capture_divert", "capture_divert_error", "total"}

// timingRows are one row per timing present: "<prefix>pre call:  1ms".
func timingRows(prefix string, timings map[string]string) [][]string {
	var rows [][]string
	for _, k := range timingKeys {
		if v, ok := timings[k]; ok {
			rows = append(rows, []string{prefix + strings.ReplaceAll(k, "_", " ") + ":", v})
		}
	}
	return rows
}

// delWhat names a kept DEL: its container and time.
func delWhat(d *adminapi.Removal) string {
	return "container " + d.ContainerID + " at " + d.At.Format(time.RFC3339)
}

// delSummary is a kept DEL on one line.
func delSummary(d *adminapi.Removal) string {
	s := delWhat(d)
	for _, k := range timingKeys {
		if v, ok := d.Timings[k]; ok && k != "started" {
			s += ", " + strings.ReplaceAll(k, "_", " ") + " " + v
		}
	}
	return s
}

func errSuffix(e string) string {
	if e == "" {
		return ""
	}
	return " (" + e + ")"
}

// inboundPolicy renders the pod's inbound policy ("-" from an agent that
// predates it), saying when an invalid annotation made it strict.
// declaredPorts renders the pod's declared TCP container ports.
func declaredPorts(p adminapi.Pod) string {
	switch {
	case !p.DeclaredPortsKnown:
		return "unknown (recorded before the agent kept them)"
	case len(p.DeclaredTCPPorts) == 0:
		return "none"
	}
	ports := make([]string, len(p.DeclaredTCPPorts))
	for i, port := range p.DeclaredTCPPorts {
		ports[i] = strconv.FormatUint(uint64(port), 10)
	}
	return strings.Join(ports, ", ") + " (TCP)"
}

func inboundPolicy(p adminapi.Pod) string {
	switch {
	case p.InboundPolicy == "":
		return "-"
	case p.InboundPolicyInvalid:
		return p.InboundPolicy + " (invalid " + meshcontract.InboundPolicyAnnotation + " annotation: served strict)"
	}
	return p.InboundPolicy
}
