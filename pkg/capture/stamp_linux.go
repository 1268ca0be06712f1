package capture

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The stamp lets a retried ADD see, in three small netlink requests, that
// the namespace still holds exactly the ruleset it wants: a rule of the
// table (the first one after a whole write, the first inserted one after an
// insertion, a kept one replaced in place after a commit that only
// deleted) carries, in its userdata, a digest of the ruleset the write
// made and the nftables generation that write's commit produced. The
// generation (NFT_MSG_GETGEN) moves with every commit in the namespace, so
// a stamp whose generation is the current one proves that nothing, neither
// another configuration nor a rule changed by hand, was committed since our
// write; its digest then says which ruleset the table holds. Stamps of
// earlier writes may stay on other rules: their generation is never the
// current one.
//
// Every rule Install writes also carries its own digest (of its
// expressions, as marshalled). While a stamp is current for another
// ruleset (a retry whose divert changed), every rule of the table is one
// Install wrote, so these digests say which rules the table holds without
// decoding any expression: the retry knows at once which rules go and
// which come, and starts the socket closer before reading anything else.
// Any other case falls back to decoding the table's rules and comparing
// them expression by expression.

// stampType is the userdata TLV type of the stamp. nft prints only a rule's
// comment (type 0) and skips other types, so the stamp never shows in
// `nft list` and the golden text stays the kernel's.
const stampType = 0xae

// stampLen is the stamp's value length: a 16-byte digest and the 4-byte
// generation.
const stampLen = 20

// ruleDigestType is the userdata TLV type of a rule's own digest (not
// printed by nft either).
const ruleDigestType = 0xaf

// ruleDigest is the digest of one rule's expressions.
type ruleDigest [8]byte

// stamp identifies a ruleset written by Install and the generation of the
// commit that wrote it.
type stamp struct {
	digest [16]byte
	gen    uint32
}

// appendTo appends s to a rule's userdata (one TLV).
func (s stamp) appendTo(b []byte) []byte {
	b = append(b, stampType, stampLen)
	b = append(b, s.digest[:]...)
	return binary.BigEndian.AppendUint32(b, s.gen)
}

// userData is s as a rule's userdata (one TLV).
func (s stamp) userData() []byte { return s.appendTo(make([]byte, 0, 2+stampLen)) }

// findTLV returns the value of the first userdata TLV of type typ and
// length n.
func findTLV(ud []byte, typ byte, n int) ([]byte, bool) {
	for len(ud) >= 2 {
		t, l := ud[0], int(ud[1])
		if len(ud) < 2+l {
			break
		}
		if t == typ && l == n {
			return ud[2 : 2+l], true
		}
		ud = ud[2+l:]
	}
	return nil, false
}

// parseStamp finds the stamp among the userdata TLVs of a rule.
func parseStamp(ud []byte) (stamp, bool) {
	v, ok := findTLV(ud, stampType, stampLen)
	if !ok {
		return stamp{}, false
	}
	var s stamp
	copy(s.digest[:], v[:16])
	s.gen = binary.BigEndian.Uint32(v[16:])
	return s, true
}

// parseRuleDigest finds a rule's own digest among its userdata TLVs.
func parseRuleDigest(ud []byte) (ruleDigest, bool) {
	v, ok := findTLV(ud, ruleDigestType, len(ruleDigest{}))
	if !ok {
		return ruleDigest{}, false
	}
	return ruleDigest(v), true
}

// nextGen is the generation the commit after gen produces (the kernel
// skips 0 when it wraps).
func nextGen(gen uint32) uint32 {
	if gen+1 == 0 {
		return 1
	}
	return gen + 1
}

// prints are the digests Install writes for a ruleset: the ruleset's
// (the stamp's) and each rule's, by chain and rule index of the ruleset.
type prints struct {
	digest [16]byte
	rules  [][]ruleDigest
}

// printsOf digests what the kernel gets for r: every chain's name and
// declaration, every rule's expressions as they are marshalled. The
// ruleset's digest covers the chains and every rule's full digest.
func printsOf(r Ruleset) (prints, error) {
	h := sha256.New()
	rh := sha256.New()
	var buf []byte
	var sum [sha256.Size]byte
	p := prints{rules: make([][]ruleDigest, len(r.Chains))}
	for ci, ch := range r.Chains {
		buf = append(buf[:0], "chain\x00"...)
		buf = append(buf, ch.Name...)
		buf = append(buf, 0)
		if ch.Hook != nil {
			buf = append(buf, ch.Type...)
			buf = binary.BigEndian.AppendUint32(buf, uint32(*ch.Hook))
			buf = binary.BigEndian.AppendUint32(buf, uint32(*ch.Priority))
		}
		h.Write(buf)
		p.rules[ci] = make([]ruleDigest, len(ch.Rules))
		for k, rl := range ch.Rules {
			rh.Reset()
			for _, e := range rl.Exprs {
				b, err := expr.Marshal(unix.NFPROTO_INET, e)
				if err != nil {
					return prints{}, fmt.Errorf("failed to marshal an expression of chain %q: %w", ch.Name, err)
				}
				rh.Write(binary.BigEndian.AppendUint32(buf[:0], uint32(len(b))))
				rh.Write(b)
			}
			rh.Sum(sum[:0])
			h.Write([]byte("rule\x00"))
			h.Write(sum[:])
			p.rules[ci][k] = ruleDigest(sum[:8])
		}
	}
	h.Sum(sum[:0])
	p.digest = [16]byte(sum[:16])
	return p, nil
}

// userData is the userdata of rule k of chain ci: its digest, after s
// when set.
func (p prints) userData(ci, k int, s *stamp) []byte {
	b := make([]byte, 0, 2+stampLen+2+len(ruleDigest{}))
	if s != nil {
		b = s.appendTo(b)
	}
	b = append(b, ruleDigestType, byte(len(ruleDigest{})))
	return append(b, p.rules[ci][k][:]...)
}

// nftQuery makes, on the install's netfilter socket in the pod namespace,
// the requests google/nftables does not make (the generation) or makes with
// more work than needed (the rules' userdata only).
type nftQuery struct {
	c *netlink.Conn
}

// request is an nftables request of type msg for family fam with attrs.
func request(msg uint16, fam byte, flags netlink.HeaderFlags, attrs ...netlink.Attribute) (netlink.Message, error) {
	data := []byte{fam, unix.NFNETLINK_V0, 0, 0}
	if len(attrs) > 0 {
		b, err := netlink.MarshalAttributes(attrs)
		if err != nil {
			return netlink.Message{}, err
		}
		data = append(data, b...)
	}
	return netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg), Flags: netlink.Request | flags},
		Data:   data,
	}, nil
}

// gen returns the namespace's nftables generation.
func (q *nftQuery) gen() (uint32, error) {
	req, err := request(unix.NFT_MSG_GETGEN, unix.AF_UNSPEC, 0)
	if err != nil {
		return 0, err
	}
	msgs, err := q.c.Execute(req)
	if err != nil {
		return 0, fmt.Errorf("failed to get the nftables generation: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, fmt.Errorf("failed to decode the nftables generation: %w", err)
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return ad.Uint32(), nil
			}
		}
	}
	return 0, errors.New("no generation in the nftables answer")
}

// hasTable reports whether the namespace holds the capture table.
func (q *nftQuery) hasTable() (bool, error) {
	req, err := request(unix.NFT_MSG_GETTABLE, unix.NFPROTO_INET, 0,
		netlink.Attribute{Type: unix.NFTA_TABLE_NAME, Data: []byte(TableName + "\x00")})
	if err != nil {
		return false, err
	}
	if _, err := q.c.Execute(req); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("failed to look up table %q: %w", TableName, err)
	}
	return true, nil
}

// tableRules is one dump of every rule of the capture table
// (NFT_MSG_GETRULE with only the table set, NLM_F_DUMP), in the kernel's
// order: chain by chain, each chain's rules in order. A retry reads the
// table's rules once, for the stamps and, when no stamp is current, for the
// comparison, instead of one dump per chain (google/nftables' GetRules
// always names a chain).
type tableRules []netlink.Message

// rules dumps the rules of the capture table.
func (q *nftQuery) rules() (tableRules, error) {
	req, err := request(unix.NFT_MSG_GETRULE, unix.NFPROTO_INET, netlink.Dump,
		netlink.Attribute{Type: unix.NFTA_RULE_TABLE, Data: []byte(TableName + "\x00")})
	if err != nil {
		return nil, err
	}
	msgs, err := q.c.Execute(req)
	if err != nil {
		return nil, fmt.Errorf("failed to list rules of table %q: %w", TableName, err)
	}
	return msgs, nil
}

// stamps returns the stamps found on the rules (only their userdata is
// decoded; a rule that cannot be decoded carries no stamp).
func (d tableRules) stamps() []stamp {
	var out []stamp
	for _, m := range d {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			continue
		}
		for ad.Next() {
			if ad.Type() == unix.NFTA_RULE_USERDATA {
				if s, ok := parseStamp(ad.Bytes()); ok {
					out = append(out, s)
				}
			}
		}
	}
	return out
}

// byChain decodes every rule (chain, handle, userdata and, when exprs is
// set, expressions) and groups them by chain name, in order. Expressions are decoded as google/nftables
// decodes them (expr.Unmarshal of the same types), so sameExprs compares
// them as it compares GetRules' answers; tproxy is left out, as
// google/nftables v0.3.0 leaves it out. An expression of any other kind
// is an error: such a rule is not one of ours, and the caller rewrites.
func (d tableRules) byChain(exprs bool) (map[string][]*nftables.Rule, error) {
	out := map[string][]*nftables.Rule{}
	for _, m := range d {
		chain, r, err := decodeRule(m, exprs)
		if err != nil {
			return nil, err
		}
		out[chain] = append(out[chain], r)
	}
	return out, nil
}

// decodeRule decodes the chain name, handle, userdata and (when exprs is
// set) expressions of a rule of the dump.
func decodeRule(m netlink.Message, exprs bool) (string, *nftables.Rule, error) {
	if len(m.Data) < 4 {
		return "", nil, errors.New("short nftables rule message")
	}
	ad, err := netlink.NewAttributeDecoder(m.Data[4:])
	if err != nil {
		return "", nil, fmt.Errorf("failed to decode a rule of table %q: %w", TableName, err)
	}
	ad.ByteOrder = binary.BigEndian
	var chain string
	r := &nftables.Rule{}
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_RULE_CHAIN:
			chain = ad.String()
		case unix.NFTA_RULE_HANDLE:
			r.Handle = ad.Uint64()
		case unix.NFTA_RULE_USERDATA:
			r.UserData = ad.Bytes()
		case unix.NFTA_RULE_EXPRESSIONS:
			if !exprs {
				continue
			}
			ad.Nested(func(list *netlink.AttributeDecoder) error {
				for list.Next() {
					list.Nested(func(elem *netlink.AttributeDecoder) error {
						e, err := decodeExpr(elem)
						if e != nil {
							r.Exprs = append(r.Exprs, e)
						}
						return err
					})
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return "", nil, fmt.Errorf("failed to decode a rule of table %q: %w", TableName, err)
	}
	r.Table = &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}
	r.Chain = &nftables.Chain{Name: chain, Table: r.Table}
	return chain, r, nil
}

// decodeExpr decodes one expression (NFTA_EXPR_NAME, NFTA_EXPR_DATA) of
// a kind the divert uses; tproxy decodes to nil (see byChain).
func decodeExpr(ad *netlink.AttributeDecoder) (expr.Any, error) {
	var name string
	var data []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_EXPR_NAME:
			name = ad.String()
		case unix.NFTA_EXPR_DATA:
			data = ad.Bytes()
		}
	}
	var e expr.Any
	switch name {
	case "tproxy":
		return nil, nil
	case "meta":
		e = &expr.Meta{}
	case "cmp":
		e = &expr.Cmp{}
	case "ct":
		e = &expr.Ct{}
	case "payload":
		e = &expr.Payload{}
	case "bitwise":
		e = &expr.Bitwise{}
	case "fib":
		e = &expr.Fib{}
	case "immediate":
		e = &expr.Immediate{}
	default:
		return nil, fmt.Errorf("nftables expression %q is not one the divert uses", name)
	}
	if err := expr.Unmarshal(unix.NFPROTO_INET, data, e); err != nil {
		return nil, fmt.Errorf("failed to decode nftables expression %q: %w", name, err)
	}
	// A verdict is an immediate that loads no data into the verdict
	// register.
	if imm, ok := e.(*expr.Immediate); ok && imm.Register == unix.NFT_REG_VERDICT && len(imm.Data) == 0 {
		v := &expr.Verdict{}
		if err := expr.Unmarshal(unix.NFPROTO_INET, data, v); err != nil {
			return nil, fmt.Errorf("failed to decode nftables verdict: %w", err)
		}
		e = v
	}
	return e, nil
}
