package client

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"text/tabwriter"

	"aether.io/node/api/istio/workload"
)

// ServiceRow is the printable form of a Service and its endpoints.
type ServiceRow struct {
	Name      string `json:"name"` // <namespace>/<hostname>
	Namespace string `json:"namespace"`
	Hostname  string `json:"hostname"`
	// VIPs are the Service's virtual IPs (none: headless).
	VIPs []string `json:"vips"`
	// Ports are "<service port>-><target port>" (target 0: named, resolved per endpoint).
	Ports     []string      `json:"ports"`
	Endpoints []EndpointRow `json:"endpoints"`
}

// EndpointRow is one endpoint workload of a Service.
type EndpointRow struct {
	UID       string   `json:"uid"`
	Name      string   `json:"name"`
	Addresses []string `json:"addresses"`
	Node      string   `json:"node,omitempty"`
	// Serving is true when the workload is HEALTHY.
	Serving bool `json:"serving"`
	// Mesh is true when the endpoint is reached over HBONE.
	Mesh bool `json:"mesh"`
	// Ports are the endpoint's "<service port>-><target port>".
	Ports []string `json:"ports"`
}

func portStrings(ps []*workload.Port) []string {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%d->%d", p.GetServicePort(), p.GetTargetPort()))
	}
	return out
}

func addrStrings(bs [][]byte) []string {
	out := make([]string, 0, len(bs))
	for _, a := range bs {
		if ip, ok := netip.AddrFromSlice(a); ok {
			out = append(out, ip.String())
		} else {
			out = append(out, fmt.Sprintf("0x%x", a))
		}
	}
	return out
}

// ServiceRows joins Services with the workloads naming them.
func ServiceRows(svcs []*workload.Service, ws []*workload.Workload) []ServiceRow {
	rows := make([]ServiceRow, 0, len(svcs))
	for _, s := range svcs {
		name := s.GetNamespace() + "/" + s.GetHostname()
		r := ServiceRow{Name: name, Namespace: s.GetNamespace(), Hostname: s.GetHostname(), VIPs: []string{}, Ports: portStrings(s.GetPorts()), Endpoints: []EndpointRow{}}
		for _, a := range s.GetAddresses() {
			r.VIPs = append(r.VIPs, addrStrings([][]byte{a.GetAddress()})...)
		}
		for _, w := range ws {
			pl, ok := w.GetServices()[name]
			if !ok {
				continue
			}
			r.Endpoints = append(r.Endpoints, EndpointRow{
				UID: w.GetUid(), Name: w.GetNamespace() + "/" + w.GetName(), Addresses: addrStrings(w.GetAddresses()), Node: w.GetNode(),
				Serving: w.GetStatus() == workload.WorkloadStatus_HEALTHY, Mesh: w.GetTunnelProtocol() == workload.TunnelProtocol_HBONE,
				Ports: portStrings(pl.GetPorts()),
			})
		}
		slices.SortFunc(r.Endpoints, func(a, b EndpointRow) int { return cmp.Compare(a.UID, b.UID) })
		rows = append(rows, r)
	}
	return rows
}

// WriteServices prints the Services as a table: one line per endpoint
// under its Service's line.
func WriteServices(out io.Writer, rows []ServiceRow) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tVIPS\tPORTS\tENDPOINT\tADDRESSES\tNODE\tSERVING\tMESH")
	yn := map[bool]string{true: "yes", false: "no"}
	for _, r := range rows {
		vips := strings.Join(r.VIPs, ",")
		if vips == "" {
			vips = "None (headless)"
		}
		if len(r.Endpoints) == 0 {
			fmt.Fprintf(tw, "%s\t%s\t%s\t(none)\t\t\t\t\n", r.Name, vips, strings.Join(r.Ports, ","))
			continue
		}
		for i, e := range r.Endpoints {
			svc, v, ports := r.Name, vips, strings.Join(e.Ports, ",")
			if i > 0 {
				svc, v = "", ""
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", svc, v, ports, e.Name, strings.Join(e.Addresses, ","), e.Node, yn[e.Serving], yn[e.Mesh])
		}
	}
	return tw.Flush()
}

// RunServices is `aetherctl services`: it subscribes to the server's
// istio.workload.Address resources once and prints every Service with its
// VIPs, ports and endpoints (node, serving, in the mesh or not).
func RunServices(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("services", flag.ContinueOnError)
	fs.SetOutput(stdout)
	cf := registerCommon(fs)
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: aetherctl services [flags]\n\nLists the Services of workload discovery (istio.workload.Address) with their VIPs, ports and endpoints.")
		fs.PrintDefaults()
	}
	opts, err := cf.parse(fs, args)
	if err != nil || opts == nil {
		return err
	}
	if len(opts.Names) > 0 {
		return fmt.Errorf("unexpected arguments %q: aetherctl services lists every Service", opts.Names)
	}
	c, err := fetchAddresses(ctx, *opts, false)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer func() { _ = c.Close() }()
	rows := ServiceRows(c.Services(), c.Workloads())
	if *cf.output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	return WriteServices(stdout, rows)
}
