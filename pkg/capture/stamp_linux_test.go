package capture

import (
	"bytes"
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// query opens a netfilter socket in pod's namespace, closed at cleanup.
func query(t *testing.T, pod *harness.NS) *nftQuery {
	t.Helper()
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(pod.Fd())})
	if err != nil {
		t.Fatalf("failed to open nftables in netns: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return &nftQuery{c: c}
}

// genOf reads the nftables generation of pod's namespace.
func genOf(t *testing.T, pod *harness.NS) uint32 {
	t.Helper()
	g, err := query(t, pod).gen()
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// rulesOf reads the rules of the capture table through google/nftables
// (one GetRules per chain), by chain name, on a connection it returns.
func rulesOf(t *testing.T, pod *harness.NS) (*nftables.Conn, map[string][]*nftables.Rule) {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(int(pod.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	tbl := &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	chains, err := tableChains(c)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := chainRules(c, tbl, chains)
	if err != nil {
		t.Fatal(err)
	}
	return c, rules
}

// handles lists the handles of every rule of the capture table.
func handles(t *testing.T, pod *harness.NS) []uint64 {
	t.Helper()
	_, rules := rulesOf(t, pod)
	var out []uint64
	for _, rs := range rules {
		for _, r := range rs {
			out = append(out, r.Handle)
		}
	}
	slices.Sort(out)
	return out
}

// stamped reports whether a rule of the table carries r's digest with the
// current generation (the next retry with r then reads nothing else).
func stamped(t *testing.T, pod *harness.NS, r Ruleset) bool {
	t.Helper()
	rules, err := query(t, pod).rules()
	if err != nil {
		t.Fatal(err)
	}
	stamps := rules.stamps()
	p, err := printsOf(r)
	if err != nil {
		t.Fatal(err)
	}
	return slices.Contains(stamps, stamp{digest: p.digest, gen: genOf(t, pod)})
}

// install installs r, verifies it, and requires a current stamp of r.
func install(t *testing.T, pod *harness.NS, r Ruleset) {
	t.Helper()
	if err := (Installer{}).InstallFd(int(pod.Fd()), r); err != nil {
		t.Fatal(err)
	}
	if err := VerifyFd(int(pod.Fd()), r); err != nil {
		t.Fatalf("Verify after install: %v", err)
	}
	if !stamped(t, pod, r) {
		t.Fatal("no current stamp of the installed ruleset")
	}
}

// TestRetryWritesOnlyWhatChanged: a retry with the same divert commits
// nothing (its stamp is current); one whose divert only adds rules inserts
// them and removes none (every earlier rule keeps its handle), in one
// commit, and stamps them so that the next retry commits nothing either;
// one whose divert lost a rule deletes just that rule (and restamps one);
// a rule deleted or added by hand moves the generation, so the retry reads
// the table back and repairs it.
func TestRetryWritesOnlyWhatChanged(t *testing.T) {
	pod := harness.NewNS(t, "stamp")
	small := Build(Config{RedirectAll: true, ExcludePorts: []uint16{22}})
	big := Build(Config{RedirectAll: true, ExcludePorts: []uint16{22, 3306}, InboundCapture: true})

	install(t, pod, small)
	g := genOf(t, pod)
	install(t, pod, small)
	if got := genOf(t, pod); got != g {
		t.Fatalf("a retry with the same divert committed (generation %d -> %d)", g, got)
	}

	before := handles(t, pod)
	install(t, pod, big)
	if got := genOf(t, pod); got != nextGen(g) {
		t.Fatalf("the insertion took generation %d -> %d, want one commit", g, got)
	}
	after := handles(t, pod)
	for _, h := range before {
		if !slices.Contains(after, h) {
			t.Fatalf("rule handle %d gone after a retry that only adds rules (before %v, after %v)", h, before, after)
		}
	}
	g = genOf(t, pod)
	install(t, pod, big)
	if got := genOf(t, pod); got != g {
		t.Fatalf("a retry after an insertion committed again (generation %d -> %d)", g, got)
	}

	// By hand: one rule deleted (the retry inserts it back in place),
	// then one rule added (the retry rewrites the table).
	c, err := nftables.New(nftables.WithNetNSFd(int(pod.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	tbl := &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	divert := &nftables.Chain{Name: "divert", Table: tbl}
	rules, err := c.GetRules(tbl, divert)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.DelRule(rules[3]); err != nil {
		t.Fatal(err)
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if VerifyFd(int(pod.Fd()), big) == nil || stamped(t, pod, big) {
		t.Fatal("Verify passed, or the stamp stayed current, after a rule was deleted by hand")
	}
	install(t, pod, big)
	c.AddRule(&nftables.Rule{Table: tbl, Chain: divert, Exprs: big.Chains[1].Rules[0].Exprs})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if VerifyFd(int(pod.Fd()), big) == nil || stamped(t, pod, big) {
		t.Fatal("Verify passed, or the stamp stayed current, after a rule was added by hand")
	}
	install(t, pod, big)

	// An exclusion fewer: only that rule goes, every other keeps its
	// handle (one is replaced by itself, in place, to carry the stamp), in
	// one commit; then an exclusion fewer and one more: one rule deleted, one
	// inserted.
	fewer := Build(Config{RedirectAll: true, ExcludePorts: []uint16{22}, InboundCapture: true})
	swapped := Build(Config{RedirectAll: true, ExcludePorts: []uint16{3306}, InboundCapture: true})
	for _, next := range []Ruleset{fewer, swapped} {
		before, g := handles(t, pod), genOf(t, pod)
		install(t, pod, next)
		if got := genOf(t, pod); got != nextGen(g) {
			t.Fatalf("the edit took generation %d -> %d, want one commit", g, got)
		}
		after := handles(t, pod)
		gone := 0
		for _, h := range before {
			if !slices.Contains(after, h) {
				gone++
			}
		}
		if gone != 1 {
			t.Fatalf("%d rule handles gone after an edit that removes one rule, want 1 (before %v, after %v)", gone, before, after)
		}
		g = genOf(t, pod)
		install(t, pod, next)
		if got := genOf(t, pod); got != g {
			t.Fatalf("a retry after an edit committed again (generation %d -> %d)", g, got)
		}
	}

	// Back to the smaller divert: a chain goes, the table is rewritten.
	install(t, pod, small)
	g = genOf(t, pod)
	install(t, pod, small)
	if got := genOf(t, pod); got != g {
		t.Fatalf("a retry after a rewrite committed again (generation %d -> %d)", g, got)
	}
}

func TestParseStamp(t *testing.T) {
	s := stamp{digest: [16]byte{1, 2, 3}, gen: 0xdeadbeef}
	comment := []byte{0, 4, 'a', 'b', 'c', 0}
	for _, tc := range []struct {
		name string
		ud   []byte
		ok   bool
	}{
		{"alone", s.userData(), true},
		{"after a comment", append(slices.Clone(comment), s.userData()...), true},
		{"comment only", comment, false},
		{"truncated", s.userData()[:10], false},
		{"wrong length", append([]byte{stampType, 3, 1, 2, 3}, comment...), false},
		{"empty", nil, false},
	} {
		got, ok := parseStamp(tc.ud)
		if ok != tc.ok || ok && got != s {
			t.Errorf("%s: parseStamp = %v, %v; want ok=%v", tc.name, got, ok, tc.ok)
		}
	}
	if nextGen(^uint32(0)) != 1 || nextGen(7) != 8 {
		t.Error("nextGen must skip 0 when the generation wraps")
	}
}

// chainRules lists the rules of each of chains, by chain name, through
// google/nftables (one dump per chain; the install reads them in one).
func chainRules(c *nftables.Conn, t *nftables.Table, chains map[string]*nftables.Chain) (map[string][]*nftables.Rule, error) {
	out := make(map[string][]*nftables.Rule, len(chains))
	for name, ch := range chains {
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return nil, fmt.Errorf("failed to list rules of chain %q: %w", name, err)
		}
		out[name] = rules
	}
	return out, nil
}

// TestTableDumpDecodes: the one dump of the table's rules that a retry
// reads decodes, chain by chain, to what google/nftables' per-chain
// GetRules reads (handles, userdata, expressions), for a ruleset with
// every kind of expression the divert uses; a rule with any other kind of
// expression makes it an error, and the retry then rewrites the table.
func TestTableDumpDecodes(t *testing.T) {
	pod := harness.NewNS(t, "dump")
	r := Build(Config{
		RedirectAll: true, ExcludePorts: []uint16{22}, InboundCapture: true,
		ExcludeCIDRs:      []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("fd00::/8")},
		InboundAllowCIDRs: []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")},
	})
	install(t, pod, r)
	c, want := rulesOf(t, pod)
	tbl := &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	dump, err := query(t, pod).rules()
	if err != nil {
		t.Fatal(err)
	}
	got, err := dump.byChain(true)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("dump has rules in %d chains, GetRules in %d", len(got), len(want))
	}
	for name, wr := range want {
		gr := got[name]
		if len(gr) != len(wr) {
			t.Fatalf("chain %s: dump has %d rules, GetRules %d", name, len(gr), len(wr))
		}
		for i := range wr {
			if gr[i].Handle != wr[i].Handle || !bytes.Equal(gr[i].UserData, wr[i].UserData) || !sameDecoded(gr[i].Exprs, wr[i].Exprs) {
				t.Errorf("chain %s rule %d: dump %+v, GetRules %+v", name, i, gr[i], wr[i])
			}
		}
	}
	for _, ch := range r.Chains {
		for i, rl := range ch.Rules {
			if !sameExprs(rl.Exprs, got[ch.Name][i].Exprs) {
				t.Errorf("chain %s rule %d decoded from the dump differs from %q", ch.Name, i, rl.Text)
			}
		}
	}

	// A rule of a kind the divert never writes (a counter).
	divert := &nftables.Chain{Name: "divert", Table: tbl}
	c.AddRule(&nftables.Rule{Table: tbl, Chain: divert, Exprs: []expr.Any{&expr.Counter{}}})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	if dump, err = query(t, pod).rules(); err != nil {
		t.Fatal(err)
	}
	if _, err := dump.byChain(true); err == nil {
		t.Fatal("a rule with a counter decoded without an error")
	}
	install(t, pod, r)
}

// sameDecoded reports whether two decoded expression lists marshal alike.
func sameDecoded(a, b []expr.Any) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		ab, err1 := expr.Marshal(unix.NFPROTO_INET, a[i])
		bb, err2 := expr.Marshal(unix.NFPROTO_INET, b[i])
		if err1 != nil || err2 != nil || !bytes.Equal(ab, bb) {
			return false
		}
	}
	return true
}

// TestEditByDigests: while nothing was committed since Install's last
// write, a retry matches the table's rules by their own digests, and that
// gives the same edit (rules deleted, rules inserted where, the rule kept
// for the stamp) as matching them expression by expression, for a retry
// that deletes, one that inserts and one that does both; once the
// generation moved, the digests are not trusted.
func TestEditByDigests(t *testing.T) {
	base := Config{RedirectAll: true, InboundCapture: true}
	cfg := func(ports ...uint16) Ruleset { c := base; c.ExcludePorts = ports; return Build(c) }
	for _, tc := range []struct {
		name      string
		from, to  Ruleset
		del, adds int
	}{
		{"deletes", cfg(22, 3306, 5432), cfg(22, 3306), 1, 0},
		{"inserts", cfg(22), cfg(22, 3306), 0, 1},
		{"both", cfg(22, 5432), cfg(3306, 5432), 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := harness.NewNS(t, "edit")
			install(t, pod, tc.from)
			p, err := printsOf(tc.to)
			if err != nil {
				t.Fatal(err)
			}
			conn, err := openNFT(int(pod.Fd()))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.CloseLasting() }()
			st, err := readStamp(conn, p.digest)
			if err != nil {
				t.Fatal(err)
			}
			if !st.present || st.current || !st.untouched {
				t.Fatalf("state after our write: present %v, current %v, untouched %v; want true, false, true", st.present, st.current, st.untouched)
			}
			light, err := st.rules.byChain(false)
			if err != nil || !allDigested(light) {
				t.Fatalf("rules without expressions: %v, every rule digested %v", err, allDigested(light))
			}
			full, err := st.rules.byChain(true)
			if err != nil {
				t.Fatal(err)
			}
			byD := ruleEdits(light, tc.to, p, byDigest(p))
			byE := ruleEdits(full, tc.to, p, byExprs(tc.to))
			if len(byD.del) != tc.del || len(byD.add) != tc.adds {
				t.Fatalf("edit by digests deletes %d and adds %d rules, want %d and %d", len(byD.del), len(byD.add), tc.del, tc.adds)
			}
			if fmt.Sprint(handlesOf(byD.del), positionsOf(byD.add), byD.kept.Handle) != fmt.Sprint(handlesOf(byE.del), positionsOf(byE.add), byE.kept.Handle) {
				t.Fatalf("edit by digests (delete %v, insert at %v, keep %d) differs from the edit by expressions (delete %v, insert at %v, keep %d)",
					handlesOf(byD.del), positionsOf(byD.add), byD.kept.Handle, handlesOf(byE.del), positionsOf(byE.add), byE.kept.Handle)
			}
			if _, ok := st.edit(tc.to, p); !ok {
				t.Fatal("no edit")
			}
		})
	}

	// A commit by anyone else (here one that adds another table) moves
	// the generation: the table is no longer untouched.
	pod := harness.NewNS(t, "edit")
	install(t, pod, cfg(22))
	c, err := nftables.New(nftables.WithNetNSFd(int(pod.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	c.AddTable(&nftables.Table{Name: "other", Family: nftables.TableFamilyINet})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	conn, err := openNFT(int(pod.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.CloseLasting() }()
	if st, err := readStamp(conn, [16]byte{}); err != nil || st.untouched {
		t.Fatalf("readStamp after another commit: untouched %v, %v; want false", st.untouched, err)
	}
}

func handlesOf(rs []*nftables.Rule) []uint64 {
	var out []uint64
	for _, r := range rs {
		out = append(out, r.Handle)
	}
	return out
}

func positionsOf(rs []*nftables.Rule) []uint64 {
	var out []uint64
	for _, r := range rs {
		out = append(out, r.Position)
	}
	return out
}
