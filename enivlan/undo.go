package enivlan

import (
	"fmt"
	"log/slog"
)

// undoStack holds what the steps of one ADD created, newest last. A step
// that creates something pushes the undo of it; if a later step fails,
// unwind runs the undos in reverse order, exactly once. This is the one
// rollback of ADD (fail closed).
type undoStack struct {
	undos []undo
}

// undo is one entry: fn removes what a step created. If fn fails, logErr
// logs it and what names it in the returned error ("deleting link
// \"eth1\""); an undo that cannot fail (a best-effort file removal) leaves
// both nil.
type undo struct {
	what   func() string
	logErr func(log *slog.Logger, err error)
	fn     func() error
}

// push records fn as the undo of a step that just succeeded.
func (s *undoStack) push(u undo) { s.undos = append(s.undos, u) }

// mark returns the stack's height, for unwindTo.
func (s *undoStack) mark() int { return len(s.undos) }

// unwind runs every undo in reverse order, empties the stack (a second
// call does nothing) and returns cause with the undos' failures appended:
// "cause (and deleting link \"eth1\" failed: ...)".
func (s *undoStack) unwind(cause error, log *slog.Logger) error {
	return s.unwindTo(0, cause, log)
}

// unwindTo is unwind for the undos pushed since mark; the older ones stay
// for a later unwind. A step that holds a lock uses it to undo its own
// work before releasing the lock.
func (s *undoStack) unwindTo(mark int, cause error, log *slog.Logger) error {
	if mark > len(s.undos) {
		mark = len(s.undos)
	}
	undos := s.undos[mark:]
	s.undos = s.undos[:mark:mark]
	for i := len(undos) - 1; i >= 0; i-- {
		u := undos[i]
		err := u.fn()
		if err == nil {
			continue
		}
		u.logErr(log, err)
		cause = fmt.Errorf("%w (and %s failed: %w)", cause, u.what(), err)
	}
	return cause
}
