package capture

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser"
)

// nftConn is one nftables netlink connection and the socket under it.
type nftConn struct {
	*nftables.Conn
	sock *mnl.Conn
}

// openNFT opens one nftables netlink connection in the namespace of fd for
// all of a caller's requests (the caller closes it): without AsLasting,
// google/nftables dials a new socket for every request, and each dial into
// another namespace runs on a goroutine of its own locked to a thread that
// enters the namespace and comes back (two setns).
func openNFT(fd int) (*nftConn, error) {
	var sock *mnl.Conn
	c, err := nftables.New(nftables.AsLasting(), nftables.WithNetNSFd(fd),
		nftables.WithSockOptions(func(nc *mnl.Conn) error { sock = nc; return nil }))
	if err != nil {
		return nil, fmt.Errorf("failed to open nftables in netns: %w", err)
	}
	return &nftConn{Conn: c, sock: sock}, nil
}

// startCloser starts the closer (if any) ahead of a commit that removes
// anything; release then hands it the socket.
func (i Installer) startCloser() bool {
	if i.Closer == nil {
		return false
	}
	i.Closer.Start()
	return true
}

// release closes c. When handOff is set (a closer was started for a
// commit that removed anything), a duplicate of its socket goes to the
// closer first, so that closing it here does not wait for the grace
// period; if the closer cannot take it, it is closed here all the same.
// An error closing it leaves nothing to act on.
func (i Installer) release(c *nftConn, handOff bool) {
	if handOff {
		err := i.handOff(c)
		switch {
		case i.Log == nil:
		case err != nil:
			i.Log.Debug("netfilter socket closed in the plugin (its release waits for a grace period)", "error", err)
		default:
			i.Log.Debug("netfilter socket handed to the socket closer")
		}
	}
	_ = c.CloseLasting()
}

// handOff sends a duplicate of c's socket to the closer.
func (i Installer) handOff(c *nftConn) error {
	if c.sock == nil {
		return errors.New("no netfilter socket to hand off")
	}
	rc, err := c.sock.SyscallConn()
	if err != nil {
		return fmt.Errorf("failed to get netfilter socket descriptor: %w", err)
	}
	f, err := sockcloser.Dup(rc, "netfilter")
	if err != nil {
		return err
	}
	defer f.Close()
	if err := i.Closer.Take([]*os.File{f}); err != nil {
		return fmt.Errorf("failed to hand the netfilter socket to a closer: %w", err)
	}
	return nil
}

// installNFT makes the namespace's capture table exactly r, in one
// nftables batch (atomic), and returns the connection for the caller to
// release, and whether a closer was started for its commit. A retried ADD
// finds the table from the first attempt. When a stamp on its rules
// (stamp_linux.go) holds r's digest and the current generation, the table
// is r: nothing is read further or written. Otherwise the table's rules
// (one dump) are matched with r's, by their own digests while a stamp is
// current (nothing committed since our last write), else expression by
// expression: a table that is r is left as it is; rules r lacks are
// deleted by handle and rules it misses are inserted in place, as are
// missing chains; a table with a chain r lacks or declares differently is
// rewritten in place (rules flushed and re-added). A commit that removes
// anything, a rule included, makes the release of the netfilter socket
// wait for an RCU grace period (meshcni/README.md), which a fresh install,
// a stamped retry and an insertion never pay; with a Closer, such a commit
// starts it as soon as the rules show that one is coming, and the socket
// is handed to it. The table or a base chain is deleted only when a base
// chain's hook, type or priority changed. Every write stamps one rule
// (its first new one, else a kept one replaced in place) with r's digest
// and the generation its commit produces; every rule written carries its
// own digest.
func (i Installer) installNFT(fd int, r Ruleset) (conn *nftConn, handOff bool, err error) {
	p, err := printsOf(r)
	if err != nil {
		return nil, false, err
	}
	if conn, err = openNFT(fd); err != nil {
		return nil, false, err
	}
	st, err := readStamp(conn, p.digest)
	if err != nil || st.current {
		return conn, false, err
	}
	c := conn.Conn
	t := &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	s := &stamp{digest: p.digest, gen: nextGen(st.gen)}
	if !st.present {
		c.AddTable(t)
		for _, ch := range r.Chains {
			c.AddChain(newChain(t, ch))
		}
		addRules(c, t, r, p, s)
		return conn, false, flush(c)
	}
	// Rules that cannot be decoded are not ours: nothing to keep, the
	// table is rewritten.
	ed, ok := st.edit(r, p)
	if ok && len(ed.del) > 0 {
		// The closer starts now, while the chains are read and the
		// commit is made.
		handOff = i.startCloser()
	}
	chains, err := tableChains(c)
	if err != nil {
		return conn, handOff, err
	}
	if ok {
		if ed.chains, ok = missingChains(chains, r); ok {
			return conn, handOff, applyEdit(c, t, ed, s)
		}
	}
	if !handOff {
		handOff = i.startCloser()
	}
	replaceInPlace(c, t, chains, r)
	addRules(c, t, r, p, s)
	return conn, handOff, flush(c)
}

// applyEdit commits ed, stamped with s: the first added rule carries the
// stamp, else (a commit that only deletes) a kept rule is replaced by
// itself, in place, with the stamp. An empty edit commits nothing.
func applyEdit(c *nftables.Conn, t *nftables.Table, ed edit, s *stamp) error {
	if len(ed.chains) == 0 && len(ed.del) == 0 && len(ed.add) == 0 {
		return nil
	}
	for _, ch := range ed.chains {
		c.AddChain(newChain(t, ch))
	}
	for _, d := range ed.del {
		if err := c.DelRule(d); err != nil {
			return fmt.Errorf("failed to delete a rule of chain %q: %w", d.Chain.Name, err)
		}
	}
	stamped := func(rl *nftables.Rule) *nftables.Rule {
		if s != nil {
			rl.UserData, s = append(s.appendTo(nil), rl.UserData...), nil
		}
		return rl
	}
	for _, in := range ed.add {
		if in.Position != 0 {
			c.InsertRule(stamped(in))
		} else {
			c.AddRule(stamped(in))
		}
	}
	if s != nil && ed.kept != nil {
		c.ReplaceRule(stamped(ed.kept))
	}
	return flush(c)
}

// tableState is what a retry reads of the namespace before deciding
// anything: the nftables generation, whether the capture table is there,
// its rules (one dump), whether a stamp on them is current for the wanted
// ruleset (current) and whether one is current at all (untouched: nothing
// was committed since Install's last write).
type tableState struct {
	gen       uint32
	present   bool
	current   bool
	untouched bool
	rules     tableRules
}

// readStamp reads, on c's socket, the namespace's nftables generation,
// whether it holds the capture table, the table's rules (one dump) and
// their stamps. One socket serves the stamp and the install: a second one
// would cost another dial into the namespace, and its release, after a
// commit that removed anything, would wait for the grace period too.
func readStamp(c *nftConn, digest [16]byte) (tableState, error) {
	if c.sock == nil {
		return tableState{}, errors.New("failed to read the capture table's stamp: no netfilter socket")
	}
	q := &nftQuery{c: c.sock}
	var st tableState
	var err error
	if st.gen, err = q.gen(); err != nil {
		return tableState{}, err
	}
	if st.present, err = q.hasTable(); err != nil || !st.present {
		return st, err
	}
	if st.rules, err = q.rules(); err != nil {
		return tableState{}, err
	}
	for _, s := range st.rules.stamps() {
		if s.gen == st.gen {
			st.untouched = true
			st.current = st.current || s.digest == digest
		}
	}
	return st, nil
}

// edit matches the table's rules with r's (p: r's digests) and returns
// the rule edit that turns them into r's; ok is false when the rules
// cannot be decoded. While the table is untouched and every rule carries
// its own digest, the digests are compared and no expression is decoded;
// otherwise the expressions are.
func (st tableState) edit(r Ruleset, p prints) (edit, bool) {
	if st.untouched {
		if have, err := st.rules.byChain(false); err == nil && allDigested(have) {
			return ruleEdits(have, r, p, byDigest(p)), true
		}
	}
	have, err := st.rules.byChain(true)
	if err != nil {
		return edit{}, false
	}
	return ruleEdits(have, r, p, byExprs(r)), true
}

// byDigest matches a rule of the table with rule k of chain ci of the
// ruleset of p by the rule's own digest.
func byDigest(p prints) func(ci, k int, h *nftables.Rule) bool {
	return func(ci, k int, h *nftables.Rule) bool {
		d, ok := parseRuleDigest(h.UserData)
		return ok && d == p.rules[ci][k]
	}
}

// byExprs matches a rule of the table with rule k of chain ci of r
// expression by expression.
func byExprs(r Ruleset) func(ci, k int, h *nftables.Rule) bool {
	return func(ci, k int, h *nftables.Rule) bool {
		return sameExprs(r.Chains[ci].Rules[k].Exprs, h.Exprs)
	}
}

// allDigested reports whether every rule of rules carries its own digest.
func allDigested(rules map[string][]*nftables.Rule) bool {
	for _, rs := range rules {
		for _, rl := range rs {
			if _, ok := parseRuleDigest(rl.UserData); !ok {
				return false
			}
		}
	}
	return true
}

// addRules queues every rule of r, in order, each with its digest and the
// first one stamped with s. Rules go after every chain: they jump to
// chains declared anywhere in the table.
func addRules(c *nftables.Conn, t *nftables.Table, r Ruleset, p prints, s *stamp) {
	for ci, ch := range r.Chains {
		for k, rl := range ch.Rules {
			c.AddRule(&nftables.Rule{Table: t, Chain: &nftables.Chain{Name: ch.Name, Table: t}, Exprs: rl.Exprs, UserData: p.userData(ci, k, s)})
			s = nil
		}
	}
}

// flush sends the queued batch.
func flush(c *nftables.Conn) error {
	if err := c.Flush(); err != nil {
		return fmt.Errorf("failed to install nftables table %q: %w", TableName, err)
	}
	return nil
}

// edit is what turns a table whose chains are all r's, declared alike,
// into r without touching a chain: chains to add, rules to delete (by
// handle), rules to add (with their digests), each at the end of its chain
// (Position 0) or before the kept rule whose handle is Position. kept is
// one rule that stays (its handle, r's expressions and digest), nil when
// none does.
type edit struct {
	chains []Chain
	del    []*nftables.Rule
	add    []*nftables.Rule
	kept   *nftables.Rule
}

// ruleEdits computes the rule edit that turns have (the table's rules by
// chain) into r's rules; same reports whether have's rule h is rule k of
// r's chain ci. Rules of chains r lacks are left to missingChains.
func ruleEdits(have map[string][]*nftables.Rule, r Ruleset, p prints, same func(ci, k int, h *nftables.Rule) bool) edit {
	var ed edit
	t := &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	for ci, ch := range r.Chains {
		nch := &nftables.Chain{Name: ch.Name, Table: t}
		// Match the rules there, in order, each to the first of r's
		// rules after the previous match that is the same; an unmatched
		// one is deleted. Each unmatched rule of r goes before the next
		// matched one, or at the end.
		keep := make([]*nftables.Rule, len(ch.Rules))
		j := 0
		for _, h := range have[ch.Name] {
			k := j
			for k < len(ch.Rules) && !same(ci, k, h) {
				k++
			}
			if k == len(ch.Rules) {
				ed.del = append(ed.del, &nftables.Rule{Table: t, Chain: nch, Handle: h.Handle})
				continue
			}
			keep[k], j = h, k+1
			if ed.kept == nil {
				ed.kept = &nftables.Rule{Table: t, Chain: nch, Handle: h.Handle, Exprs: ch.Rules[k].Exprs, UserData: p.userData(ci, k, nil)}
			}
		}
		for k, rl := range ch.Rules {
			if keep[k] != nil {
				continue
			}
			var pos uint64
			for _, h := range keep[k+1:] {
				if h != nil {
					pos = h.Handle
					break
				}
			}
			ed.add = append(ed.add, &nftables.Rule{Table: t, Chain: nch, Exprs: rl.Exprs, Position: pos, UserData: p.userData(ci, k, nil)})
		}
	}
	return ed
}

// missingChains returns r's chains the table (holding chains) lacks; ok is
// false when the table has a chain r lacks or declares differently.
func missingChains(chains map[string]*nftables.Chain, r Ruleset) ([]Chain, bool) {
	want := map[string]Chain{}
	for _, ch := range r.Chains {
		want[ch.Name] = ch
	}
	for name, got := range chains {
		if ch, ok := want[name]; !ok || !sameBase(ch, got) {
			return nil, false
		}
	}
	var missing []Chain
	for _, ch := range r.Chains {
		if _, ok := chains[ch.Name]; !ok {
			missing = append(missing, ch)
		}
	}
	return missing, true
}

// newChain is the nftables chain of ch in t.
func newChain(t *nftables.Table, ch Chain) *nftables.Chain {
	nch := &nftables.Chain{Name: ch.Name, Table: t}
	if ch.Hook != nil {
		pol := nftables.ChainPolicyAccept
		nch.Type, nch.Hooknum, nch.Priority, nch.Policy = ch.Type, ch.Hook, ch.Priority, &pol
	}
	return nch
}

// sameBase reports whether the table's chain got is declared as want
// (both regular, or the same type, hook and priority).
func sameBase(want Chain, got *nftables.Chain) bool {
	if (want.Hook == nil) != (got.Hooknum == nil) {
		return false
	}
	return want.Hook == nil || *want.Hook == *got.Hooknum && *want.Priority == *got.Priority && want.Type == got.Type
}

// tableChains lists the chains of our table by name.
func tableChains(c *nftables.Conn) (map[string]*nftables.Chain, error) {
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("failed to list chains of table %q: %w", TableName, err)
	}
	have := map[string]*nftables.Chain{}
	for _, ch := range chains {
		if ch.Table.Name == TableName {
			have[ch.Name] = ch
		}
	}
	return have, nil
}

// replaceInPlace queues, on c, the changes that turn the table holding
// chains into r's chains with no rules: every chain r keeps is flushed,
// chains r lacks (or declares differently) are deleted, missing ones are
// added. Flushes come first, so a deleted chain is no longer a jump target.
func replaceInPlace(c *nftables.Conn, t *nftables.Table, chains map[string]*nftables.Chain, r Ruleset) {
	want := map[string]Chain{}
	for _, ch := range r.Chains {
		want[ch.Name] = ch
	}
	keep := map[string]bool{}
	var drop []*nftables.Chain
	for _, got := range chains {
		c.FlushChain(got)
		if ch, ok := want[got.Name]; ok && sameBase(ch, got) {
			keep[got.Name] = true
		} else {
			drop = append(drop, got)
		}
	}
	for _, got := range drop {
		c.DelChain(got)
	}
	for _, ch := range r.Chains {
		if !keep[ch.Name] {
			c.AddChain(newChain(t, ch))
		}
	}
}

// Present reports whether the namespace at nsPath holds the capture table.
func (Installer) Present(nsPath string) (bool, error) {
	present := false
	err := inNS(nsPath, func(fd int) error {
		c, err := openNFT(fd)
		if err != nil {
			return err
		}
		defer func() { _ = c.CloseLasting() }()
		present, err = hasTable(c.Conn)
		return err
	})
	return present, err
}

// hasTable reports whether c's namespace holds the capture table.
func hasTable(c *nftables.Conn) (bool, error) {
	_, err := c.ListTableOfFamily(TableName, nftables.TableFamilyINet)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("failed to list table %q: %w", TableName, err)
	}
	return true, nil
}

// verifyChains checks that table t, holding the chains have, holds exactly
// r's chains and rules.
func verifyChains(c *nftables.Conn, t *nftables.Table, have map[string]*nftables.Chain, r Ruleset) error {
	if len(have) != len(r.Chains) {
		return fmt.Errorf("table inet %s has %d chains, want %d", TableName, len(have), len(r.Chains))
	}
	for _, want := range r.Chains {
		got, ok := have[want.Name]
		if !ok {
			return fmt.Errorf("chain %s missing from table inet %s", want.Name, TableName)
		}
		if !sameBase(want, got) {
			return fmt.Errorf("chain %s of table inet %s changed type, hook or priority", want.Name, TableName)
		}
		rules, err := c.GetRules(t, got)
		if err != nil {
			return fmt.Errorf("failed to list rules of chain %q: %w", want.Name, err)
		}
		if len(rules) != len(want.Rules) {
			return fmt.Errorf("chain %s has %d rules, want %d", want.Name, len(rules), len(want.Rules))
		}
		for i, wr := range want.Rules {
			if !sameExprs(wr.Exprs, rules[i].Exprs) {
				return fmt.Errorf("chain %s rule %d differs from %q", want.Name, i, wr.Text)
			}
		}
	}
	return nil
}

func sameExprs(a, b []expr.Any) bool {
	// google/nftables v0.3.0 does not decode tproxy expressions it reads
	// back, so they are left out of the comparison; the tproxy port lives in
	// the immediate before it and the family in the nfproto match, both
	// compared.
	a = slices.DeleteFunc(slices.Clone(a), func(e expr.Any) bool { _, ok := e.(*expr.TProxy); return ok })
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		// Nor does it decode a ct statement's source register ("ct mark
		// set"): it reads back as a ct load into register 0. The key is
		// compared; the value is the immediate before it.
		if set, ok := a[i].(*expr.Ct); ok && set.SourceRegister {
			got, ok := b[i].(*expr.Ct)
			if !ok || got.Key != set.Key || got.Register != 0 && got.Register != set.Register {
				return false
			}
			continue
		}
		ab, err1 := expr.Marshal(unix.NFPROTO_INET, a[i])
		bb, err2 := expr.Marshal(unix.NFPROTO_INET, b[i])
		if err1 != nil || err2 != nil || !bytes.Equal(ab, bb) {
			return false
		}
	}
	return true
}

// removeTable deletes the capture table; with a Closer, the socket of the
// delete (whose release waits for the grace period) is handed to it.
func (i Installer) removeTable(fd int) error {
	nc, err := openNFT(fd)
	if err != nil {
		return err
	}
	handOff := false
	defer func() { i.release(nc, handOff) }()
	if ok, err := hasTable(nc.Conn); !ok || err != nil {
		return err
	}
	handOff = i.startCloser()
	nc.DelTable(&nftables.Table{Name: TableName, Family: nftables.TableFamilyINet})
	if err := nc.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("failed to delete nftables table %q: %w", TableName, err)
	}
	return nil
}
