package hbone

import (
	"fmt"
	"sync"
)

// Defaults of BudgetConfig (see README.md, "Memory and connection bounds").
const (
	// DefaultMaxConns caps the HBONE connections (in the handshake or
	// established) of every Server sharing a Budget: the node's :15008.
	DefaultMaxConns = 1024
	// DefaultMaxConnsPerSource caps those of one source address (a pod).
	DefaultMaxConnsPerSource = 64
	// DefaultWindowBudget bounds the receive window granted beyond HTTP/2's
	// initial 64 KiB per connection, summed over every connection sharing
	// the Budget.
	DefaultWindowBudget = 128 << 20
	// DefaultWindowBudgetPerSource bounds that of one source (a pod).
	DefaultWindowBudgetPerSource = 16 << 20
	// DefaultSendBufs and DefaultSendBufsPerSource bound the 256 KiB send
	// buffers the streams of the Servers (or of the Dialer) sharing a
	// Budget hold while their DATA is written (a peer that reads slowly
	// makes writes wait, up to WriteTimeout): 64 MiB per node, 8 MiB per
	// source.
	DefaultSendBufs          = 256
	DefaultSendBufsPerSource = 32
	// DefaultControlBudget bounds the control frames (PING and SETTINGS
	// acks, WINDOW_UPDATE, RST_STREAM) queued for peers beyond the first
	// controlFloor bytes of each connection's queue, summed over every
	// connection sharing the Budget: with 1024 connections at most 32 MiB
	// + 1024 × 2 × 16 KiB = 64 MiB, where each connection's own 1 MiB
	// bound alone allowed 1 GiB queued (and as much again being written).
	DefaultControlBudget = 32 << 20
	// DefaultControlBudgetPerSource bounds that of one source (a pod): a
	// source that does not read spends at most 4 MiB of the node's 32.
	DefaultControlBudgetPerSource = 4 << 20
)

// BudgetConfig sets the bounds of a Budget; a zero field takes its Default.
type BudgetConfig struct {
	// MaxConns and MaxConnsPerSource cap open connections in total and per
	// source (the Server's: TCP accepted, handshakes included).
	MaxConns, MaxConnsPerSource int
	// Window and WindowPerSource bound, in bytes, the receive window the
	// connections grant beyond the initial 64 KiB each, in total and per
	// source. Queued DATA never exceeds the window granted, so they bound
	// the memory a peer that sends to a reader that does not read can take.
	Window, WindowPerSource int64
	// SendBufs and SendBufsPerSource bound the send buffers (256 KiB
	// each: an upstream's or a pod's socket read, or a Stream.Write's
	// frames) the streams of the Servers or of the Dialer hold at once
	// while sending, in total and per source; a stream waits for one
	// without a buffer.
	SendBufs, SendBufsPerSource int
	// Control bounds, in bytes, the control frames queued for peers (and
	// being written to them) beyond the first 16 KiB of each queue, summed
	// over the connections sharing the Budget. A connection whose queue
	// would take more than what is left is closed as a control flood, as
	// one past its own 1 MiB is. ControlPerSource bounds the same per
	// source.
	Control, ControlPerSource int64
}

// Budget is shared by the Servers of a node (or given to the Dialer): it
// caps the connections they hold, the receive window they grant, the send
// buffers their streams hold and the control frames they queue, in total
// and per source (the client's address for a Server, the Request's Origin
// for the Dialer). A connection over a cap is closed at accept; a
// connection that finds the window budget spent gets what is left (at
// least HTTP/2's initial 64 KiB, which needs no grant): slower, never
// refused. It is safe for concurrent use.
type Budget struct {
	cfg BudgetConfig

	sendBufs chan struct{} // a token per send buffer held

	mu      sync.Mutex
	conns   int
	window  int64
	control int64 // control-frame bytes charged (chargeControl)
	per     map[string]*budgetUse
}

type budgetUse struct {
	conns   int
	window  int64
	control int64
	// sendBufs is the source's send-buffer tokens, shared by its
	// connections (refs of them hold it).
	sendBufs chan struct{}
	refs     int
}

// NewBudget returns a Budget for cfg.
func NewBudget(cfg BudgetConfig) (*Budget, error) {
	orDefault(&cfg.MaxConns, DefaultMaxConns)
	orDefault(&cfg.MaxConnsPerSource, DefaultMaxConnsPerSource)
	if err := budgetPair(&cfg.Window, &cfg.WindowPerSource, DefaultWindowBudget, DefaultWindowBudgetPerSource, "window budget"); err != nil {
		return nil, err
	}
	if err := budgetPair(&cfg.Control, &cfg.ControlPerSource, DefaultControlBudget, DefaultControlBudgetPerSource, "control-frame budget"); err != nil {
		return nil, err
	}
	cfg.ControlPerSource = min(cfg.ControlPerSource, cfg.Control)
	if cfg.MaxConnsPerSource > cfg.MaxConns {
		cfg.MaxConnsPerSource = cfg.MaxConns
	}
	orDefault(&cfg.SendBufs, DefaultSendBufs)
	orDefault(&cfg.SendBufsPerSource, DefaultSendBufsPerSource)
	cfg.SendBufsPerSource = min(cfg.SendBufsPerSource, cfg.SendBufs)
	return &Budget{cfg: cfg, per: map[string]*budgetUse{}, sendBufs: make(chan struct{}, cfg.SendBufs)}, nil
}

// budgetPair gives a total and a per-source bound in bytes their
// defaults when zero; what names them in the error for a negative one.
func budgetPair(total, per *int64, defTotal, defPer int64, what string) error {
	if *total == 0 {
		*total = defTotal
	}
	if *per == 0 {
		*per = defPer
	}
	if *total < 0 || *per < 0 {
		return fmt.Errorf("invalid hbone %s %d / %d per source: must not be negative", what, *total, *per)
	}
	return nil
}

// defaultBudget is the Budget of a Server or Dialer configured without one.
func defaultBudget() *Budget {
	b, _ := NewBudget(BudgetConfig{})
	return b
}

// Config returns the bounds in force (defaults applied).
func (b *Budget) Config() BudgetConfig { return b.cfg }

// use returns src's entry, created when absent (b.mu held).
func (b *Budget) useLocked(src string) *budgetUse {
	u := b.per[src]
	if u == nil {
		u = &budgetUse{}
		b.per[src] = u
	}
	return u
}

// forgetLocked drops src's entry once it holds nothing (b.mu held).
func (b *Budget) forgetLocked(src string, u *budgetUse) {
	if u.conns == 0 && u.window == 0 && u.control == 0 && u.refs == 0 {
		delete(b.per, src)
	}
}

// sendSlots are the send-buffer tokens of one connection: the node's and
// its source's.
type sendSlots struct {
	node, src chan struct{}
}

// slots returns src's send-buffer tokens for a connection, until
// dropSlots.
func (b *Budget) slots(src string) sendSlots {
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	if u.sendBufs == nil {
		u.sendBufs = make(chan struct{}, b.cfg.SendBufsPerSource)
	}
	u.refs++
	return sendSlots{node: b.sendBufs, src: u.sendBufs}
}

// dropSlots ends a connection's use of src's tokens.
func (b *Budget) dropSlots(src string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	u.refs--
	b.forgetLocked(src, u)
}

// tryTake takes a token of both, without waiting.
func (s sendSlots) tryTake() bool {
	select {
	case s.src <- struct{}{}:
	default:
		return false
	}
	select {
	case s.node <- struct{}{}:
		return true
	default:
		<-s.src
		return false
	}
}

// give returns the tokens tryTake or acquire took.
func (s sendSlots) give() {
	<-s.node
	<-s.src
}

// acquire takes a token of both, waiting for each (the source's first)
// until it is free, or until stop is closed (false, nothing held). Tokens
// given back go to the waiters in turn (a channel hands a waiting sender
// the room a receive made). It does not probe for room with a send and a
// receive: with other waiters blocked in their sends, that receive hands
// the room to the next of them while the channel stays full, so the room
// goes round the waiters and no tryTake ever gets it.
func (s sendSlots) acquire(stop <-chan struct{}) bool {
	select {
	case s.src <- struct{}{}:
	case <-stop:
		return false
	}
	select {
	case s.node <- struct{}{}:
		return true
	case <-stop:
		<-s.src
		return false
	}
}

// admitConn takes a connection slot of src; false when a cap is reached.
func (b *Budget) admitConn(src string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	if b.conns >= b.cfg.MaxConns || u.conns >= b.cfg.MaxConnsPerSource {
		b.forgetLocked(src, u)
		return false
	}
	b.conns++
	u.conns++
	return true
}

// leaveConn gives back a slot admitConn took.
func (b *Budget) leaveConn(src string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	b.conns--
	u.conns--
	b.forgetLocked(src, u)
}

// reserveWindow takes up to want bytes of window for src and returns how
// many it got (0 when the budget is spent).
func (b *Budget) reserveWindow(src string, want int64) int64 {
	return b.take(src, want, true, func(u *budgetUse) (*int64, *int64, int64, int64) {
		return &b.window, &u.window, b.cfg.Window, b.cfg.WindowPerSource
	})
}

// releaseWindow gives back n bytes reserveWindow gave src.
func (b *Budget) releaseWindow(src string, n int64) {
	b.give(src, n, func(u *budgetUse) (*int64, *int64) { return &b.window, &u.window })
}

// chargeControl takes n bytes of src's and the node's control-frame
// budget; false, taking nothing, when fewer are left.
func (b *Budget) chargeControl(src string, n int64) bool {
	return b.take(src, n, false, func(u *budgetUse) (*int64, *int64, int64, int64) {
		return &b.control, &u.control, b.cfg.Control, b.cfg.ControlPerSource
	}) == n
}

// releaseControl gives back n bytes chargeControl gave src.
func (b *Budget) releaseControl(src string, n int64) {
	b.give(src, n, func(u *budgetUse) (*int64, *int64) { return &b.control, &u.control })
}

// take takes up to want of an amount the Budget bounds in total and per
// source (amount returns the node's and src's use and their caps): what
// is left when partial, else all of want or nothing. It returns what it
// took.
func (b *Budget) take(src string, want int64, partial bool, amount func(*budgetUse) (node, per *int64, nodeCap, perCap int64)) int64 {
	if want <= 0 {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	node, per, nodeCap, perCap := amount(u)
	got := max(0, min(want, nodeCap-*node, perCap-*per))
	if !partial && got < want {
		got = 0
	}
	*node += got
	*per += got
	b.forgetLocked(src, u)
	return got
}

// give gives back n of what take took for src.
func (b *Budget) give(src string, n int64, amount func(*budgetUse) (node, per *int64)) {
	if n <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	u := b.useLocked(src)
	node, per := amount(u)
	*node -= n
	*per -= n
	b.forgetLocked(src, u)
}

// BudgetStats is a snapshot of a Budget's use.
type BudgetStats struct {
	// Conns is the number of connections holding a slot.
	Conns int
	// Window is the receive window reserved, in bytes.
	Window int64
	// Sources is the number of sources holding a slot or window.
	Sources int
	// SendBufs is the number of send buffers held.
	SendBufs int
	// Control is the control-frame bytes queued or being written beyond
	// each connection's first 16 KiB (BudgetConfig.Control).
	Control int64
}

// Stats returns a snapshot of the Budget's use.
func (b *Budget) Stats() BudgetStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return BudgetStats{Conns: b.conns, Window: b.window, Sources: len(b.per), SendBufs: len(b.sendBufs), Control: b.control}
}
