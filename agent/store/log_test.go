package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// open opens dir with opts and closes the store at the end of the test
// (Close is idempotent, so tests may close earlier).
func open(t *testing.T, dir string, opts Options) *Store {
	t.Helper()
	s, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func put(t *testing.T, s *Store, recs ...*Record) {
	t.Helper()
	for _, r := range recs {
		if err := s.Put(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
}

func keys(t *testing.T, s *Store) []string {
	t.Helper()
	all, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range all {
		out = append(out, r.Key())
	}
	return out
}

func wantKeys(t *testing.T, s *Store, want ...string) {
	t.Helper()
	if got := keys(t, s); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("records = %v, want %v", got, want)
	}
}

// frames returns the offset and size of every intact frame of the log in
// dir, in order, and the log's bytes.
func frames(t *testing.T, dir string) ([][2]int64, []byte) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, FileName))
	if err != nil {
		t.Fatal(err)
	}
	if string(data[:headerSize]) != fileMagic {
		t.Fatalf("log starts with %q", data[:headerSize])
	}
	var out [][2]int64
	for off := headerSize; ; {
		_, _, size, err := parseFrame(data[off:])
		if err != nil {
			return out, data
		}
		out = append(out, [2]int64{off, size})
		off += size
	}
}

func writeLog(t *testing.T, dir string, data []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, FileName), data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// logBuffer returns a logger writing JSON lines to the returned buffer.
func logBuffer() (*slog.Logger, *bytes.Buffer) {
	var b bytes.Buffer
	return slog.New(slog.NewJSONHandler(&b, nil)), &b
}

// TestTornTail: a commit cut by a crash (a frame missing its end, or whole
// but not matching its checksum, as the last frame) is cut off on Open
// without a quarantine; later appends never bring its bytes back.
func TestTornTail(t *testing.T) {
	for _, tc := range []struct {
		name string
		tear func(frame []byte) []byte
	}{
		{name: "half a frame", tear: func(f []byte) []byte { return f[:len(f)/2] }},
		{name: "header only", tear: func(f []byte) []byte { return f[:frameHeader] }},
		{name: "whole frame, bad checksum", tear: func(f []byte) []byte { f[len(f)-3] ^= 0x40; return f }},
		{name: "first page of the frame, zeros after", tear: func(f []byte) []byte {
			clear(f[len(f)/3:])
			return f
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, dir, Options{})
			put(t, s, rec(1), rec(2), rec(3))
			s.Close()

			fr, data := frames(t, dir)
			end := fr[len(fr)-1][0] + fr[len(fr)-1][1]
			body, _ := encodeEnvelope(rec(4))
			torn := tc.tear(appendFrame(nil, kindPut, body))
			copy(data[end:], torn)
			writeLog(t, dir, data)

			logger, logs := logBuffer()
			s = open(t, dir, Options{Logger: logger})
			wantKeys(t, s, "c-0001", "c-0002", "c-0003")
			if s.Quarantined() != 0 {
				t.Fatalf("quarantined %d on a torn tail, want 0", s.Quarantined())
			}
			if !allZero(torn) && !strings.Contains(logs.String(), "cut the torn tail of the record log") {
				t.Fatalf("no torn-tail log line in %s", logs)
			}
			put(t, s, rec(5)) // shorter than nothing: lands where the torn frame was
			s.Close()
			fr, data = frames(t, dir)
			end = fr[len(fr)-1][0] + fr[len(fr)-1][1]
			if !allZero(data[end:]) {
				t.Fatalf("bytes of the torn frame left after the last frame")
			}
			s = open(t, dir, Options{})
			wantKeys(t, s, "c-0001", "c-0002", "c-0003", "c-0005")
		})
	}
}

// TestDamageInTheMiddle: a damaged frame followed by intact ones is not a
// torn tail. The rule: the damaged bytes are quarantined (kept in a file,
// counted, logged at ERROR) and every intact frame after them is kept; the
// log is rewritten, so the next Open finds nothing to quarantine.
func TestDamageInTheMiddle(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(frame []byte)
	}{
		{name: "flipped bit in the payload", damage: func(f []byte) { f[len(f)/2] ^= 0x08 }},
		{name: "flipped bit in the length", damage: func(f []byte) { f[2] ^= 0x01 }},
		{name: "zeroed", damage: func(f []byte) { clear(f) }},
		{name: "zeroed length only", damage: func(f []byte) { clear(f[:4]) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			s := open(t, dir, Options{})
			put(t, s, rec(1), rec(2), rec(3), rec(4))
			s.Close()

			fr, data := frames(t, dir)
			bad := fr[1]
			orig := append([]byte(nil), data[bad[0]:bad[0]+bad[1]]...)
			tc.damage(data[bad[0] : bad[0]+bad[1]])
			writeLog(t, dir, data)

			var seen []error
			logger, logs := logBuffer()
			s = open(t, dir, Options{Logger: logger, OnQuarantine: func(_ string, err error) { seen = append(seen, err) }})
			wantKeys(t, s, "c-0001", "c-0003", "c-0004")
			if s.Quarantined() != 1 || len(seen) != 1 {
				t.Fatalf("quarantined %d (%v), want 1", s.Quarantined(), seen)
			}
			if !strings.Contains(logs.String(), `"level":"ERROR","msg":"quarantined corrupt pod record"`) {
				t.Fatalf("no ERROR line for the damage in %s", logs)
			}
			qs, err := os.ReadDir(filepath.Join(dir, QuarantineDir))
			if err != nil || len(qs) != 1 {
				t.Fatalf("quarantine dir: %v, %v", qs, err)
			}
			kept, _ := os.ReadFile(filepath.Join(dir, QuarantineDir, qs[0].Name()))
			if len(kept) != len(orig) {
				t.Fatalf("kept %d damaged bytes, the frame had %d", len(kept), len(orig))
			}
			put(t, s, rec(5))
			s.Close()

			s = open(t, dir, Options{})
			wantKeys(t, s, "c-0001", "c-0003", "c-0004", "c-0005")
			if s.Quarantined() != 0 {
				t.Fatalf("quarantined %d again on the next Open", s.Quarantined())
			}
			if n, _ := s.QuarantineCount(); n != 1 {
				t.Fatalf("QuarantineCount = %d, want 1", n)
			}
		})
	}
}

// TestUndecodableRecordQuarantined: intact frames whose record does not
// decode (unknown version, no container ID, not JSON) are quarantined; the
// others stay.
func TestUndecodableRecordQuarantined(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	put(t, s, rec(1))
	s.Close()
	fr, data := frames(t, dir)
	end := fr[len(fr)-1][0] + fr[len(fr)-1][1]
	var extra []byte
	for _, body := range []string{`{"v":9}`, `{"v":1,"pod":{}}`, `{not json`} {
		extra = appendFrame(extra, kindPut, []byte(body))
	}
	good, _ := encodeEnvelope(rec(2))
	extra = appendFrame(extra, kindPut, good)
	copy(data[end:], extra)
	writeLog(t, dir, data)

	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001", "c-0002")
	if s.Quarantined() != 3 {
		t.Fatalf("quarantined %d, want 3", s.Quarantined())
	}
	s.Close()
	s = open(t, dir, Options{})
	if s.Quarantined() != 0 {
		t.Fatalf("quarantined %d again", s.Quarantined())
	}
	wantKeys(t, s, "c-0001", "c-0002")
}

// TestCompaction: once dead frames pass CompactMin and outweigh the live
// records the log is rewritten with the live records only; state (puts,
// replacements, deletes) is the same before and after, and after a reopen.
func TestCompaction(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{CompactMin: 8 << 10, Preallocate: 4 << 10})
	ctx := context.Background()
	want := map[string]*Record{}
	for round := 0; round < 20; round++ {
		for i := 0; i < 20; i++ {
			r := rec(i)
			r.Pod.Name = fmt.Sprintf("p-%d-round-%d", i, round)
			put(t, s, r)
			want[r.Key()] = r
		}
		for i := round % 3; i < 20; i += 3 {
			if err := s.Delete(ctx, rec(i).Key()); err != nil {
				t.Fatal(err)
			}
			delete(want, rec(i).Key())
		}
	}
	if s.compactions == 0 {
		t.Fatal("no compaction after 400 puts and 140 deletes of 20 keys")
	}
	check := func(s *Store) {
		t.Helper()
		all, err := s.List()
		if err != nil || len(all) != len(want) {
			t.Fatalf("List = %d records, %v; want %d", len(all), err, len(want))
		}
		for _, r := range all {
			equal(t, r, want[r.Key()])
		}
	}
	check(s)
	s.Close()
	fi, err := os.Stat(filepath.Join(dir, FileName))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > 64<<10 {
		t.Fatalf("log is %d bytes after compactions, want it bounded", fi.Size())
	}
	if _, err := os.Stat(filepath.Join(dir, compactName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("compaction file left: %v", err)
	}
	s = open(t, dir, Options{})
	check(s)
}

// TestUnfinishedCompaction: a compaction file left by a crash before its
// rename is removed, and the log it was built from is read.
func TestUnfinishedCompaction(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	put(t, s, rec(1))
	s.Close()
	if err := os.WriteFile(filepath.Join(dir, compactName), []byte(fileMagic+"partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001")
	if _, err := os.Stat(filepath.Join(dir, compactName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("compaction file left: %v", err)
	}
}

// TestImportBbolt: an agent.db of the bbolt store is imported (its records
// and its quarantine), agent.db removed, and it is the authority over a log
// beside it.
func TestImportBbolt(t *testing.T) {
	dir := t.TempDir()
	// A log written before a downgrade: c-0009 was deleted since.
	s := open(t, dir, Options{})
	put(t, s, rec(9), rec(1))
	s.Close()

	legacy := func(r *Record) []byte {
		body, err := encodeEnvelope(r)
		if err != nil {
			t.Fatal(err)
		}
		return appendLegacyCRC(body)
	}
	db, err := bolt.Open(filepath.Join(dir, LegacyFileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		pods, err := tx.CreateBucket(legacyBucketPods)
		if err != nil {
			return err
		}
		q, err := tx.CreateBucket(legacyBucketQuarantine)
		if err != nil {
			return err
		}
		for i := 1; i <= 3; i++ {
			if err := pods.Put([]byte(rec(i).Key()), legacy(rec(i))); err != nil {
				return err
			}
		}
		if err := pods.Put([]byte("elsewhere"), legacy(rec(4))); err != nil {
			return err
		}
		return q.Put([]byte("c-0007@123"), []byte("old damage"))
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}

	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001", "c-0002", "c-0003")
	got, err := s.Get("c-0002")
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, rec(2))
	if s.Quarantined() != 1 {
		t.Fatalf("quarantined %d, want 1 (the record under another key)", s.Quarantined())
	}
	if n, _ := s.QuarantineCount(); n != 2 {
		t.Fatalf("QuarantineCount = %d, want 2 (imported and new)", n)
	}
	if _, err := os.Stat(filepath.Join(dir, LegacyFileName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("agent.db still there after the import: %v", err)
	}
	put(t, s, rec(5))
	s.Close()
	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001", "c-0002", "c-0003", "c-0005")
	if s.Quarantined() != 0 {
		t.Fatalf("quarantined %d on the next Open", s.Quarantined())
	}
}

func appendLegacyCRC(body []byte) []byte {
	out := make([]byte, 4, 4+len(body))
	sum := crc32.Checksum(body, castagnoli)
	out[0], out[1], out[2], out[3] = byte(sum>>24), byte(sum>>16), byte(sum>>8), byte(sum)
	return append(out, body...)
}

// TestLock: a second Open of a directory in use fails with ErrLocked and
// names the lock file; it succeeds once the first store is closed.
func TestLock(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	_, err := Open(dir, Options{LockTimeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), LockFileName) {
		t.Fatalf("second Open = %v, want ErrLocked naming %s", err, LockFileName)
	}
	s.Close()
	s2 := open(t, dir, Options{LockTimeout: 100 * time.Millisecond})
	put(t, s2, rec(1))
}

// TestNotALog: a file that is not a record log is refused, not overwritten.
func TestNotALog(t *testing.T) {
	dir := t.TempDir()
	junk := []byte("some other program's data, long enough to hold a header")
	writeLog(t, dir, junk)
	if _, err := Open(dir, Options{}); err == nil || !strings.Contains(err.Error(), "not an agent record log") {
		t.Fatalf("Open of a foreign file = %v", err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, FileName)); !bytes.Equal(got, junk) {
		t.Fatal("the foreign file was changed")
	}
}

// TestWriteFailureRefusesLaterWrites: once a commit's write fails the file's
// state is unknown; that write and every later one fail until a reopen,
// which reads back what is on disk.
func TestWriteFailureRefusesLaterWrites(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{})
	put(t, s, rec(1))
	// The committer is idle (Put returned); the next commit finds the
	// file closed under it, as a write error would.
	if err := s.f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(context.Background(), rec(2)); err == nil {
		t.Fatal("Put on a failed file succeeded")
	}
	err := s.Put(context.Background(), rec(3))
	if err == nil || !strings.Contains(err.Error(), "store failed, restart to recover") {
		t.Fatalf("Put after a failed write = %v, want the store refusing", err)
	}
	if got, _ := s.Get("c-0002"); got != nil {
		t.Fatal("a failed write is readable")
	}
	s.Close()
	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001")
}

// TestRandomDamage: whatever bytes of a log are flipped, zeroed or cut,
// Open succeeds and every record it returns is one that was written, whole;
// a record whose frame lies before the first damaged byte is always there.
func TestRandomDamage(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, Options{NoSync: true})
	var all []*Record
	for i := 0; i < 30; i++ {
		all = append(all, rec(i))
	}
	put(t, s, all...)
	s.Close()
	fr, pristine := frames(t, dir)
	end := fr[len(fr)-1][0] + fr[len(fr)-1][1]
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := 0; iter < 200; iter++ {
		data := append([]byte(nil), pristine...)
		first := end
		for range 1 + rng.IntN(4) {
			at := headerSize + rng.Int64N(end-headerSize)
			first = min(first, at)
			switch rng.IntN(3) {
			case 0:
				data[at] ^= byte(1 + rng.IntN(255))
			case 1:
				clear(data[at:min(end, at+rng.Int64N(300))])
			case 2:
				clear(data[at:]) // cut: the rest reads as preallocated space
			}
		}
		d := t.TempDir()
		if err := os.WriteFile(filepath.Join(d, FileName), data, 0o600); err != nil {
			t.Fatal(err)
		}
		s, err := Open(d, Options{NoSync: true, Preallocate: 4 << 10})
		if err != nil {
			t.Fatalf("iteration %d: Open = %v", iter, err)
		}
		got, err := s.List()
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, r := range got {
			var i int
			if _, err := fmt.Sscanf(r.Key(), "c-%04d", &i); err != nil || i >= len(all) {
				t.Fatalf("iteration %d: record %q was never written", iter, r.Key())
			}
			equal(t, r, all[i])
			seen[r.Key()] = true
		}
		for i, f := range fr {
			if f[0]+f[1] <= first && !seen[all[i].Key()] {
				t.Fatalf("iteration %d: record %q before the damage at %d is gone", iter, all[i].Key(), first)
			}
		}
		_ = s.Close()
	}
}

// TestFullDiskFailsOnlyTheCommit: a commit that cannot extend the log's
// space (a full disk) fails its callers with the cause, writes nothing and
// leaves the store working: the next commit, once space is back, succeeds,
// and a reopen finds every acknowledged record and none of the failed one.
func TestFullDiskFailsOnlyTheCommit(t *testing.T) {
	dir := t.TempDir()
	var full atomic.Bool
	s := open(t, dir, Options{Preallocate: 4 << 10, preallocate: func(f *os.File, off, n int64) error {
		if full.Load() {
			return syscall.ENOSPC
		}
		return preallocate(f, off, n)
	}})
	put(t, s, rec(1))
	full.Store(true)
	big := rec(2)
	big.UncapturedError = strings.Repeat("x", 8<<10) // does not fit in the space left
	err := s.Put(context.Background(), big)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Put with the disk full = %v, want ENOSPC", err)
	}
	if got, _ := s.Get(big.Key()); got != nil {
		t.Fatal("the failed record is readable")
	}
	full.Store(false)
	put(t, s, rec(3), big)
	s.Close()
	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001", "c-0002", "c-0003")
}

// TestCompactionFailureKeepsTheLog: a compaction that fails before its
// rename leaves the log in use and the store writing; it is not retried at
// every commit but once another CompactMin of dead bytes piled up, and then
// succeeds. No compact file is left behind.
func TestCompactionFailureKeepsTheLog(t *testing.T) {
	dir := t.TempDir()
	var armed, fail atomic.Bool
	var tries atomic.Int32
	s := open(t, dir, Options{CompactMin: 8 << 10, Preallocate: 4 << 10, beforeRename: func() error {
		if !armed.Load() { // Open's compaction of a new log
			return nil
		}
		tries.Add(1)
		if fail.Load() {
			return syscall.EIO
		}
		return nil
	}})
	armed.Store(true)
	fail.Store(true)
	r := rec(1)
	for i := 0; tries.Load() == 0; i++ {
		if i > 1000 {
			t.Fatal("no compaction tried after 1000 replacements of one record")
		}
		r.Pod.Name = fmt.Sprintf("p-1-round-%d", i)
		put(t, s, r)
	}
	// The committer is serial: this commit runs after the failed
	// compaction ended.
	put(t, s, rec(2)) // the store still writes
	if _, err := os.Stat(filepath.Join(dir, compactName)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("compact file after a failed compaction: %v, want none", err)
	}
	if got := tries.Load(); got != 1 {
		t.Fatalf("compaction tried %d times right after failing, want once", got)
	}
	fail.Store(false)
	for i := 0; tries.Load() < 2; i++ {
		if i > 1000 {
			t.Fatal("compaction not tried again after the failure, 1000 replacements later")
		}
		r.Pod.Name = fmt.Sprintf("p-1-again-%d", i)
		put(t, s, r)
	}
	s.Close() // waits for the committer
	if s.compactions == 0 {
		t.Fatal("the retried compaction did not complete")
	}
	s.Close()
	s = open(t, dir, Options{})
	wantKeys(t, s, "c-0001", "c-0002")
	if got, _ := s.Get(r.Key()); got == nil || got.Pod.Name != r.Pod.Name {
		t.Fatalf("record after compaction = %v, want the last put (%s)", got, r.Pod.Name)
	}
}
