package enivlan

import (
	"log/slog"
	"testing"
	"time"
)

// TestUTCTime: the record's time is written in UTC, the same instant;
// other attributes, and a "time" inside a group, are left alone.
func TestUTCTime(t *testing.T) {
	at := time.Date(2026, 12, 1, 18, 4, 5, 6, time.FixedZone("UTC+1", 3600))
	got := utcTime(nil, slog.Time(slog.TimeKey, at)).Value.Time()
	if got.Location() != time.UTC || !got.Equal(at) || got.Hour() != 17 {
		t.Errorf("record time %v, want %v in UTC", got, at)
	}
	if a := utcTime([]string{"g"}, slog.Time(slog.TimeKey, at)); a.Value.Time().Location() == time.UTC {
		t.Errorf("a time in group g was changed: %v", a)
	}
	if a := utcTime(nil, slog.Time("since", at)); a.Value.Time().Location() == time.UTC {
		t.Errorf("attribute since was changed: %v", a)
	}
	if a := utcTime(nil, slog.String(slog.TimeKey, "x")); a.Value.String() != "x" {
		t.Errorf("non-time attribute %v", a)
	}
}
