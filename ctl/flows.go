package ctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"time"

	"aether.io/node/pkg/flowapi"
)

// RunFlows is `aetherctl flows`: the node's connection events as they
// happen (as `hubble observe` follows Cilium's), from aether-proxy's flows
// socket, filtered by the proxy before they are queued. It runs until ctx
// ends (Ctrl-C) or --count events came. Flags: --socket, --pod,
// --namespace, --denied, --service, --reporter, -o table|json, --count.
func RunFlows(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("aetherctl flows", flag.ContinueOnError)
	fs.SetOutput(stdout)
	var req flowapi.Request
	socket := fs.String("socket", flowapi.DefaultSocket, "aether-proxy's flows socket (its -flows-socket)")
	fs.StringVar(&req.Pod, "pod", "", "only connections with this pod at either end: <namespace>/<name>")
	fs.StringVar(&req.Namespace, "namespace", "", "only connections with a workload of this namespace at either end")
	fs.BoolVar(&req.Denied, "denied", false, "only connections a policy refused")
	fs.StringVar(&req.Service, "service", "", "only connections through this Service: its hostname or <namespace>/<name>")
	fs.StringVar(&req.Reporter, "reporter", "", "only one side's events: source or destination")
	output := fs.String("o", "table", "output format: table, or json (one object per line, as the proxy sends it)")
	count := fs.Int("count", 0, "stop after this many events (0: until interrupted)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) > 0:
		return fmt.Errorf("unexpected arguments %q: aetherctl flows takes flags only", pos)
	case *output != "table" && *output != "json":
		return fmt.Errorf("invalid -o %q: want table or json", *output)
	case *count < 0:
		return fmt.Errorf("invalid --count %d: want 0 (no end) or more", *count)
	}
	if err := req.Validate(); err != nil {
		return err
	}
	s, err := flowapi.Subscribe(ctx, *socket, req)
	if err != nil {
		return err
	}
	defer func() { _ = s.Close() }()
	var render func(flowapi.Message)
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetEscapeHTML(false)
		render = func(m flowapi.Message) { _ = enc.Encode(m) }
	} else {
		render = renderFlowTable(stdout, s.Queue)
	}
	for events := 0; *count == 0 || events < *count; {
		m, err := s.Next()
		switch {
		case ctx.Err() != nil:
			return nil // interrupted: the normal end
		case errors.Is(err, io.EOF):
			return fmt.Errorf("aether-proxy closed the flows stream of %q (it stopped)", *socket)
		case err != nil:
			return fmt.Errorf("failed to read flows from %q: %w", *socket, err)
		}
		render(m)
		if m.Event != nil {
			events++
		}
	}
	return nil
}

// flowColumns are the table's header and its column widths (the last
// column is not padded).
var flowColumns = []struct {
	name  string
	width int
}{
	{"TIME (UTC)", 12},
	{"REPORTER", 11},
	{"EVENT", 6},
	{"SOURCE", 26},
	{"DESTINATION", 30},
	{"SERVICE", 26},
	{"PATH", 11},
	{"SECURITY", 10},
	{"BYTES →/←", 13},
	{"REASON / POLICY", 0},
}

// renderFlowTable prints the header and returns the function that prints
// one row per event, and a comment line per drop notice (queue: the
// proxy's queue bound). Rows are written
// as they come, so the columns have fixed widths (a longer value shifts
// the rest of its row).
func renderFlowTable(w io.Writer, queue int) func(flowapi.Message) {
	row := func(cells ...string) {
		line := ""
		for i, c := range cells {
			if i < len(cells)-1 {
				c = fmt.Sprintf("%-*s ", flowColumns[i].width, c)
			}
			line += c
		}
		fmt.Fprintln(w, line)
	}
	var header []string
	for _, c := range flowColumns {
		header = append(header, c.name)
	}
	row(header...)
	return func(m flowapi.Message) {
		switch {
		case m.Type == flowapi.TypeDropped:
			fmt.Fprintf(w, "# %d events dropped: read more slowly than the connections came (the proxy queues %d per reader)\n", m.Dropped, queue)
			return
		case m.Event == nil:
			return
		}
		e := m.Event
		at, event, bytes, reason := e.StartTime, "open", "-", "-"
		if m.Type == flowapi.TypeClosed {
			at, event = e.EndTime, "close"
			bytes = strconv.FormatInt(e.BytesToDst, 10) + "/" + strconv.FormatInt(e.BytesToSrc, 10)
			reason = closeReason(e)
		}
		row(clock(at), e.Reporter, event, end(e.SrcNamespace, e.SrcPod, e.SrcAddr, false), end(e.DstNamespace, e.DstPod, e.DstAddr, true),
			dash(e.DstService), dash(e.Path), dash(e.Security), bytes, reason)
	}
}

// clock is an RFC 3339 time's time of day in UTC, to the millisecond.
func clock(s string) string {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return dash(s)
	}
	return t.UTC().Format("15:04:05.000")
}

// end names one end of a connection: its pod (<namespace>/<name>, with
// the address's port for the destination) when the proxy knows it, else
// its address.
func end(namespace, pod, addr string, port bool) string {
	if pod == "" {
		return dash(addr)
	}
	s := namespace + "/" + pod
	if ap, err := netip.ParseAddrPort(addr); err == nil && port {
		s += ":" + strconv.Itoa(int(ap.Port()))
	}
	return s
}

// closeReason is how a connection ended, with the policy that decided and
// the limit it hit, when any.
func closeReason(e *flowapi.Event) string {
	s := dash(e.Reason)
	if e.PolicyDecision != "" && e.PolicyDecision != "none" {
		s += " (" + e.PolicyDecision
		if e.Policy != "" {
			s += " by " + e.Policy
		}
		if e.PolicyReason != "" {
			s += ": " + e.PolicyReason
		}
		s += ")"
	}
	if e.Limit != "" {
		s += " " + e.Limit
	}
	if e.PolicyDryRun != "" {
		s += " (dry-run " + e.PolicyDryRun + ")"
	}
	return s
}
