package hbone

import "testing"

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
