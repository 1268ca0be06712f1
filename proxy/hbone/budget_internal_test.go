package hbone

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestBudget: connection slots are capped per source and in total; window
// reservations get what is left of both shares (possibly nothing), and
// everything given back is reusable.
func TestBudget(t *testing.T) {
	b, err := NewBudget(BudgetConfig{MaxConns: 3, MaxConnsPerSource: 2, Window: 10, WindowPerSource: 6})
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range []struct {
		src  string
		want bool
	}{{"a", true}, {"a", true}, {"a", false}, {"b", true}, {"c", false}} {
		if got := b.admitConn(tt.src); got != tt.want {
			t.Fatalf("admit %d (%s) = %v, want %v", i, tt.src, got, tt.want)
		}
	}
	b.leaveConn("a")
	if !b.admitConn("c") {
		t.Fatal("a slot given back was not reusable")
	}
	for i, tt := range []struct {
		src        string
		want, got0 int64
	}{{"a", 4, 4}, {"a", 4, 2}, {"b", 8, 4}, {"c", 8, 0}} {
		if got := b.reserveWindow(tt.src, tt.want); got != tt.got0 {
			t.Fatalf("reserve %d (%s, %d) = %d, want %d", i, tt.src, tt.want, got, tt.got0)
		}
	}
	b.releaseWindow("a", 6)
	if got := b.reserveWindow("c", 8); got != 6 {
		t.Fatalf("reserve after release = %d, want 6", got)
	}
	if _, err := NewBudget(BudgetConfig{Window: -1}); err == nil {
		t.Fatal("a negative window budget was accepted")
	}
	if st := b.Stats(); st.Conns != 3 || st.Window != 10 {
		t.Fatalf("stats = %+v, want 3 conns and a window of 10", st)
	}
}

// sendSlotWaiters returns how many goroutines are blocked on a channel
// under sendSlots (waiting for a send-buffer token).
func sendSlotWaiters() int {
	buf := make([]byte, 1<<20)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		blocked := strings.Contains(g, "[chan send") || strings.Contains(g, "[select")
		if blocked && strings.Contains(g, "hbone.sendSlots.") {
			n++
		}
	}
	return n
}

// TestSendSlotsFreedGoesToWaiter: with its source's only send buffer
// held and 16 streams waiting, each buffer given back goes to one
// waiter, which holds it until it gives it back in turn. Before, a waiter
// probed for a free token with a send and a receive on the full token
// channel: the receive handed the freed room to the next waiter blocked
// in its send, which did the same, so the room went round the waiters
// for ever, the channel stayed full and no waiter could take it (every
// stream of the source spinning, allocating as it went: the failures of
// TestSlowReaderSendBuffersBounded under load).
func TestSendSlotsFreedGoesToWaiter(t *testing.T) {
	b, err := NewBudget(BudgetConfig{SendBufs: 4, SendBufsPerSource: 1})
	if err != nil {
		t.Fatal(err)
	}
	s := b.slots("a")
	if !s.tryTake() {
		t.Fatal("no send buffer free at the start")
	}
	stop := make(chan struct{})
	defer close(stop)
	const waiters = 16
	got := make(chan struct{}, waiters)
	for range waiters {
		go func() {
			if s.acquire(stop) {
				got <- struct{}{}
			}
		}()
	}
	for sendSlotWaiters() < waiters {
		runtime.Gosched()
	}
	if s.tryTake() {
		t.Fatal("a second send buffer taken with a cap of 1")
	}
	guard := time.NewTimer(20 * time.Second) // a hang guard, not a timing bound
	defer guard.Stop()
	for i := range waiters {
		s.give()
		select {
		case <-got:
		case <-guard.C:
			t.Fatalf("the send buffer given back %d was not taken by any of the %d waiters (they pass it round)", i+1, waiters-i)
		}
		if st := b.Stats(); st.SendBufs != 1 {
			t.Fatalf("%d send buffers held after a waiter took the one given back, want 1", st.SendBufs)
		}
	}
	s.give()
	if st := b.Stats(); st.SendBufs != 0 {
		t.Fatalf("%d send buffers held after all were given back, want 0", st.SendBufs)
	}
}

// TestSendSlotsAcquireStops: a stream waiting for a send buffer stops
// waiting when its stop channel closes, holding nothing.
func TestSendSlotsAcquireStops(t *testing.T) {
	b, err := NewBudget(BudgetConfig{SendBufs: 1, SendBufsPerSource: 1})
	if err != nil {
		t.Fatal(err)
	}
	s := b.slots("a")
	if !s.tryTake() {
		t.Fatal("no send buffer free at the start")
	}
	stop := make(chan struct{})
	res := make(chan bool)
	go func() { res <- s.acquire(stop) }()
	for sendSlotWaiters() < 1 {
		runtime.Gosched()
	}
	close(stop)
	if <-res {
		t.Fatal("acquire took a send buffer none was free of")
	}
	s.give()
	if st := b.Stats(); st.SendBufs != 0 {
		t.Fatalf("%d send buffers held, want 0", st.SendBufs)
	}
}
