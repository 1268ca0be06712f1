package client

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"aether.io/node/api/istio/security"
	"aether.io/node/api/istio/workload"
	"aether.io/node/pkg/authz"
)

// fetchAddresses dials for the Addresses (and, with policies, the
// Authorizations) and waits for the first response of each type.
func fetchAddresses(ctx context.Context, opts Options, policies bool) (*Client, error) {
	opts.Addresses, opts.Authorizations = true, policies
	c, err := Dial(ctx, opts)
	if err != nil {
		return nil, err
	}
	types := 1
	if policies {
		types = 2
	}
	for range types {
		if _, err := c.Recv(); err != nil {
			_ = c.Close()
			return nil, err
		}
	}
	return c, nil
}

// appliedPolicies returns the keys of the policies that select w, in the
// order the proxy evaluates them: mesh-wide, its namespace's, then those
// it is bound to.
func appliedPolicies(w *workload.Workload, pols []*security.Authorization) []string {
	var out []string
	for _, scope := range []security.Scope{security.Scope_GLOBAL, security.Scope_NAMESPACE} {
		for _, p := range pols {
			if p.GetScope() == scope && (scope == security.Scope_GLOBAL || p.GetNamespace() == w.GetNamespace()) {
				out = append(out, p.GetNamespace()+"/"+p.GetName())
			}
		}
	}
	return append(out, w.GetAuthorizationPolicies()...)
}

// RunPolicies is `aetherctl policies`: every workload with the policies
// that select it, and every policy served.
func RunPolicies(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("policies", flag.ContinueOnError)
	fs.SetOutput(stdout)
	cf := registerCommon(fs)
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: aetherctl policies [flags]\n\nLists every workload with the authorization policies that select it, then every policy served (istio.security.Authorization).")
		fs.PrintDefaults()
	}
	opts, err := cf.parse(fs, args)
	if err != nil || opts == nil {
		return err
	}
	c, err := fetchAddresses(ctx, *opts, true)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	pols := c.Policies()
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKLOAD\tNODE\tPOLICIES")
	for _, w := range c.Workloads() {
		applied := appliedPolicies(w, pols)
		list := "-"
		if len(applied) > 0 {
			list = strings.Join(applied, ",")
		}
		fmt.Fprintf(tw, "%s/%s\t%s\t%s\n", w.GetNamespace(), w.GetName(), w.GetNode(), list)
	}
	fmt.Fprintln(tw, "\nPOLICY\tSCOPE\tACTION\tRULES")
	for _, p := range pols {
		action := p.GetAction().String()
		if p.GetDryRun() {
			action += " (dry-run)"
		}
		fmt.Fprintf(tw, "%s/%s\t%s\t%s\t%d\n", p.GetNamespace(), p.GetName(), p.GetScope(), action, len(p.GetGroups()))
	}
	return tw.Flush()
}

// RunPolicyCheck is `aetherctl policy check <src ns/pod> <dst ns/pod>[:port]`:
// the decision the destination's proxy makes for an HBONE connection from
// the source workload (its SPIFFE identity and first address) to the
// destination's first address and port, and the policy that made it.
func RunPolicyCheck(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("policy check", flag.ContinueOnError)
	fs.SetOutput(stdout)
	cf := registerCommon(fs)
	plaintext := fs.Bool("plaintext", false, "decide a plaintext connection (no identity) instead of HBONE")
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: aetherctl policy check [flags] <src namespace/pod> <dst namespace/pod>[:port]\n\nPrints the decision the destination's proxy makes and the policy that made it.")
		fs.PrintDefaults()
	}
	opts, err := cf.parse(fs, args)
	if err != nil || opts == nil {
		return err
	}
	if len(opts.Names) != 2 {
		return fmt.Errorf("invalid arguments %q: want <src namespace/pod> <dst namespace/pod>[:port]", opts.Names)
	}
	src, dstArg := opts.Names[0], opts.Names[1]
	opts.Names = nil
	var port uint16
	if name, p, ok := strings.Cut(dstArg, ":"); ok {
		n, err := strconv.ParseUint(p, 10, 16)
		if err != nil || n == 0 {
			return fmt.Errorf("invalid port %q in %q: want 1-65535", p, dstArg)
		}
		dstArg, port = name, uint16(n)
	}
	c, err := fetchAddresses(ctx, *opts, true)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	find := func(id string) (*workload.Workload, error) {
		ns, name, ok := strings.Cut(id, "/")
		if !ok {
			return nil, fmt.Errorf("invalid workload %q: want namespace/pod", id)
		}
		i := slices.IndexFunc(c.Workloads(), func(w *workload.Workload) bool { return w.GetNamespace() == ns && w.GetName() == name })
		if i < 0 {
			return nil, fmt.Errorf("workload %s is not served by workload discovery", id)
		}
		return c.Workloads()[i], nil
	}
	sw, err := find(src)
	if err != nil {
		return err
	}
	dw, err := find(dstArg)
	if err != nil {
		return err
	}
	first := func(w *workload.Workload) netip.Addr {
		if len(w.GetAddresses()) > 0 {
			if a, ok := netip.AddrFromSlice(w.GetAddresses()[0]); ok {
				return a.Unmap()
			}
		}
		return netip.Addr{}
	}
	t := authz.NewTable()
	for _, p := range c.Policies() {
		if err := t.Upsert(p); err != nil {
			fmt.Fprintf(stdout, "warning: %v\n", err)
		}
	}
	conn := &authz.Conn{Source: first(sw), Dest: netip.AddrPortFrom(first(dw), port)}
	if !*plaintext && sw.GetTrustDomain() != "" {
		sa := sw.GetServiceAccount()
		if sa == "" {
			sa = "default"
		}
		conn.Identity = "spiffe://" + sw.GetTrustDomain() + "/ns/" + sw.GetNamespace() + "/sa/" + sa
	}
	d := t.Decide(conn, authz.Target{Namespace: dw.GetNamespace(), Policies: dw.GetAuthorizationPolicies()})
	verdict := "DENY"
	if d.Allow {
		verdict = "ALLOW"
	}
	identity := conn.Identity
	if identity == "" {
		identity = "none (plaintext)"
	}
	fmt.Fprintf(stdout, "%s: %s -> %s (%s)\n", verdict, src, dstArg, d.Reason)
	fmt.Fprintf(stdout, "  source identity: %s, address %s; destination %s\n", identity, conn.Source, conn.Dest)
	if d.Policy != "" {
		fmt.Fprintf(stdout, "  decided by: %s\n", d.Policy)
	}
	if d.DryRun != "" {
		fmt.Fprintf(stdout, "  dry-run: %s would change the decision (not enforced)\n", d.DryRun)
	}
	if port == 0 {
		fmt.Fprintln(stdout, "  no port given: rules naming ports were evaluated against port 0 (give <dst>:<port>)")
	}
	fmt.Fprintf(stdout, "  policies selecting the destination: %s\n", strings.Join(appliedPolicies(dw, c.Policies()), ", "))
	return nil
}
