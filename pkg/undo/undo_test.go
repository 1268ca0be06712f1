package undo

import (
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
)

func TestUndoStack(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	tests := []struct {
		name    string
		failing map[string]bool
		mark    int // UnwindTo(mark) first, then Unwind
		order   []string
		msg     string
	}{
		{name: "reverse order", order: []string{"c", "b", "a"}, msg: "cause"},
		{
			name: "failures appended newest first", failing: map[string]bool{"a": true, "c": true}, order: []string{"c", "b", "a"},
			msg: "cause (and undoing c failed: c broke) (and undoing a failed: a broke)",
		},
		{name: "partial unwind then the rest", mark: 1, order: []string{"c", "b", "a"}, msg: "cause"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s Stack
			var ran []string
			for _, n := range []string{"a", "b", "c"} {
				s.Push(Entry{What: func() string { return "undoing " + n }, LogErr: func(*slog.Logger, error) {}, Fn: func() error {
					ran = append(ran, n)
					if tt.failing[n] {
						return errors.New(n + " broke")
					}
					return nil
				}})
			}
			err := errors.New("cause")
			if tt.mark > 0 {
				err = s.UnwindTo(tt.mark, err, log)
			}
			err = s.Unwind(err, log)
			_ = s.Unwind(errors.New("again"), log) // exactly once: nothing left
			if !slices.Equal(ran, tt.order) {
				t.Errorf("ran %v, want %v", ran, tt.order)
			}
			if err.Error() != tt.msg || !strings.HasPrefix(err.Error(), "cause") {
				t.Errorf("error %q, want %q", err, tt.msg)
			}
		})
	}
}
