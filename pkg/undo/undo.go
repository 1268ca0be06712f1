// Package undo is the one rollback of a verb made of named steps (a CNI
// ADD): each step that creates something pushes the undo of it, and if a
// later step fails the stack is unwound once, newest first (fail closed).
package undo

import (
	"fmt"
	"log/slog"
)

// Stack holds what the steps of one verb created, newest last. A step
// that creates something pushes the undo of it; if a later step fails,
// Unwind runs the undos in reverse order, exactly once. The zero value is
// an empty stack.
type Stack struct {
	undos []Entry
}

// Entry is one undo: Fn removes what a step created. If Fn fails, LogErr
// logs it and What names it in the returned error ("deleting link
// \"eth1\""); an undo that cannot fail (a best-effort file removal, or one
// that logs its own failure) leaves both nil.
type Entry struct {
	What   func() string
	LogErr func(log *slog.Logger, err error)
	Fn     func() error
}

// Push records u as the undo of a step that just succeeded.
func (s *Stack) Push(u Entry) { s.undos = append(s.undos, u) }

// Mark returns the stack's height, for UnwindTo.
func (s *Stack) Mark() int { return len(s.undos) }

// Unwind runs every undo in reverse order, empties the stack (a second
// call does nothing) and returns cause with the undos' failures appended:
// "cause (and deleting link \"eth1\" failed: ...)".
func (s *Stack) Unwind(cause error, log *slog.Logger) error {
	return s.UnwindTo(0, cause, log)
}

// UnwindTo is Unwind for the undos pushed since mark; the older ones stay
// for a later Unwind. A step that holds a lock uses it to undo its own
// work before releasing the lock.
func (s *Stack) UnwindTo(mark int, cause error, log *slog.Logger) error {
	if mark > len(s.undos) {
		mark = len(s.undos)
	}
	undos := s.undos[mark:]
	s.undos = s.undos[:mark:mark]
	for i := len(undos) - 1; i >= 0; i-- {
		u := undos[i]
		err := u.Fn()
		if err == nil {
			continue
		}
		u.LogErr(log, err)
		cause = fmt.Errorf("%w (and %s failed: %w)", cause, u.What(), err)
	}
	return cause
}
