package client

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"text/tabwriter"

	"aether.io/node/api/istio/workload"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/pkg/tlsfiles"
)

// DefaultSocket is the agent's xDS socket (aether-agent's --xds-socket
// default, in the directory it shares with aether-proxy).
const DefaultSocket = meshcontract.ProxySocketDir + "/" + meshcontract.XDSSocketName

// Row is the printable form of a workload (JSON output).
type Row struct {
	UID            string   `json:"uid"`
	Name           string   `json:"name"`
	Namespace      string   `json:"namespace"`
	Addresses      []string `json:"addresses"`
	Node           string   `json:"node,omitempty"`
	Status         string   `json:"status"`
	WorkloadType   string   `json:"workload_type"`
	WorkloadName   string   `json:"workload_name,omitempty"`
	ServiceAccount string   `json:"service_account,omitempty"`
	ClusterID      string   `json:"cluster_id,omitempty"`
	NetworkMode    string   `json:"network_mode,omitempty"`
	// Services are the Services the workload is an endpoint of
	// (<namespace>/<hostname>), sorted.
	Services []string `json:"services,omitempty"`
}

// RowOf renders w; addresses that are not 4 or 16 bytes print as hex.
func RowOf(w *workload.Workload) Row {
	r := Row{
		UID: w.GetUid(), Name: w.GetName(), Namespace: w.GetNamespace(), Node: w.GetNode(),
		Status: w.GetStatus().String(), WorkloadType: w.GetWorkloadType().String(), WorkloadName: w.GetWorkloadName(),
		ServiceAccount: w.GetServiceAccount(), ClusterID: w.GetClusterId(), Addresses: []string{},
	}
	r.Services = slices.Sorted(maps.Keys(w.GetServices()))
	if w.GetNetworkMode() != workload.NetworkMode_STANDARD {
		r.NetworkMode = w.GetNetworkMode().String()
	}
	for _, a := range w.GetAddresses() {
		if ip, ok := netip.AddrFromSlice(a); ok {
			r.Addresses = append(r.Addresses, ip.String())
		} else {
			r.Addresses = append(r.Addresses, fmt.Sprintf("0x%x", a))
		}
	}
	return r
}

// WriteTable prints the workloads as an aligned table.
func WriteTable(out io.Writer, ws []*workload.Workload) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "UID\tNAME\tNAMESPACE\tADDRESSES\tNODE\tSTATUS\tTYPE\tWORKLOAD\tSERVICES")
	for _, w := range ws {
		r := RowOf(w)
		svcs := "-"
		if len(r.Services) > 0 {
			svcs = strings.Join(r.Services, ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.UID, r.Name, r.Namespace,
			strings.Join(r.Addresses, ","), r.Node, r.Status, r.WorkloadType, r.WorkloadName, svcs)
	}
	return tw.Flush()
}

// event is one line of --watch -o json.
type event struct {
	Event    string `json:"event"`
	UID      string `json:"uid"`
	Workload *Row   `json:"workload,omitempty"`
}

// Run is `aetherctl workloads`: it subscribes to the server's workloads,
// prints them as a table or JSON and, with --watch, keeps printing changes
// until ctx ends.
func Run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("workloads", flag.ContinueOnError)
	fs.SetOutput(stdout)
	cf := registerCommon(fs)
	watch := fs.Bool("watch", false, "keep streaming changes after the initial list")
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: aetherctl workloads [flags] [uid ...]\n\nLists istio.workload.Workload resources from a delta xDS server (all, or the given uids).")
		fs.PrintDefaults()
	}
	opts, err := cf.parse(fs, args)
	if err != nil || opts == nil {
		return err
	}
	output := cf.output
	c, err := Dial(ctx, *opts)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	if _, err := c.Recv(); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	if *output == "json" && !*watch {
		rows := []Row{}
		for _, w := range c.Workloads() {
			rows = append(rows, RowOf(w))
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		for _, w := range c.Workloads() {
			r := RowOf(w)
			if err := enc.Encode(event{Event: "put", UID: r.UID, Workload: &r}); err != nil {
				return err
			}
		}
	} else if err := WriteTable(stdout, c.Workloads()); err != nil {
		return err
	}
	if !*watch {
		return nil
	}
	for {
		up, err := c.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		for _, w := range up.Updated {
			r := RowOf(w)
			if *output == "json" {
				if err := json.NewEncoder(stdout).Encode(event{Event: "put", UID: r.UID, Workload: &r}); err != nil {
					return err
				}
				continue
			}
			fmt.Fprintf(stdout, "PUT     %s  %s/%s  %s  %s  %s  %s/%s\n", r.UID, r.Namespace, r.Name,
				strings.Join(r.Addresses, ","), r.Node, r.Status, r.WorkloadType, r.WorkloadName)
		}
		for _, n := range up.Removed {
			if *output == "json" {
				if err := json.NewEncoder(stdout).Encode(event{Event: "removed", UID: n}); err != nil {
					return err
				}
				continue
			}
			fmt.Fprintf(stdout, "REMOVED %s\n", n)
		}
	}
}

// commonFlags are the flags every xDS subcommand of aetherctl takes.
type commonFlags struct {
	socket, address, output, node, serverName *string
	files                                     tlsfiles.Files
}

func registerCommon(fs *flag.FlagSet) *commonFlags {
	c := &commonFlags{
		socket:  fs.String("xds-socket", DefaultSocket, "unix socket of the xDS server (ignored when --xds-address is set)"),
		address: fs.String("xds-address", "", "host:port of the xDS server (instead of --xds-socket)"),
		output:  fs.String("o", "table", "output format: table or json"),
		node:    fs.String("node-id", "aetherctl", "node id sent to the server"),
	}
	fs.StringVar(&c.files.Cert, "tls-cert", "", "PEM client certificate for --xds-address (mutual TLS; with --tls-key and --tls-ca)")
	fs.StringVar(&c.files.Key, "tls-key", "", "PEM private key of --tls-cert")
	fs.StringVar(&c.files.CA, "tls-ca", "", "PEM bundle that verifies the server's certificate")
	c.serverName = fs.String("tls-server-name", "", "name the server's certificate must carry (default: the host of --xds-address)")
	return c
}

// parse parses args and returns the client options; nil options and no
// error mean --help was printed.
func (c *commonFlags) parse(fs *flag.FlagSet, args []string) (*Options, error) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, nil
		}
		return nil, err
	}
	if *c.output != "table" && *c.output != "json" {
		return nil, fmt.Errorf("invalid output format %q: use table or json", *c.output)
	}
	opts := &Options{NodeID: *c.node, Names: fs.Args()}
	if *c.address != "" {
		opts.Address = *c.address
	} else {
		opts.Socket = *c.socket
	}
	files := c.files
	switch {
	case files.Empty():
	case !files.Complete():
		return nil, fmt.Errorf("invalid --tls-cert %q, --tls-key %q, --tls-ca %q: give all three or none", files.Cert, files.Key, files.CA)
	case *c.address == "":
		return nil, errors.New("invalid --tls-cert/--tls-key/--tls-ca: they secure --xds-address, which is not set")
	default:
		r, err := tlsfiles.NewReloader(files, nil)
		if err != nil {
			return nil, err
		}
		name := *c.serverName
		if name == "" {
			if name, _, err = net.SplitHostPort(*c.address); err != nil {
				return nil, fmt.Errorf("invalid --xds-address %q: want host:port: %w", *c.address, err)
			}
		}
		opts.TLS = r.ClientConfig(name)
	}
	return opts, nil
}
