// Package store keeps the agent's durable pod records in an append-only
// record log under the state directory (agent.log): one record per sandbox
// (container) ID, holding everything needed to rebuild the pod's endpoint
// and xDS resources without the API server.
//
// Every Put appends the record's frame (length, CRC-32C, payload) and every
// Delete a tombstone. Writes from concurrent callers share commits (group
// commit): one goroutine owns the file and writes every request queued while
// the previous commit was syncing with one write and one fdatasync, so eight
// concurrent AddPods cost about one sync, not eight, and a lone writer waits
// for no timer. A caller is answered only once its frame is on disk.
//
// The file's space is allocated ahead (zero-filled) so an append changes
// neither the size nor the allocation: fdatasync has only data to flush.
// When dead frames (replaced records, tombstones) outweigh the live ones the
// log is compacted: the live records are written to a new file, synced and
// renamed over the log. On Open the log is read up to its end; a torn tail
// (a commit cut by a crash, never acknowledged) is cut off, damage followed
// by intact frames is quarantined and logged at ERROR, and the intact frames
// after it are kept (README.md). An agent.db of the bbolt store this package
// used before is imported once and removed.
package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"time"
)

// FileName is the record log inside the state directory.
const FileName = "agent.log"

// LockFileName is the file whose flock keeps a second agent out of the
// state directory.
const LockFileName = "agent.lock"

// LegacyFileName is the bbolt database of agents before the record log;
// Open imports it and removes it.
const LegacyFileName = "agent.db"

// QuarantineDir is the directory, inside the state directory, that keeps
// the bytes of every damaged or undecodable frame Open moved aside.
const QuarantineDir = "quarantine"

// compactName is the file a compaction writes before renaming it over the
// log; one left by a crash is removed on Open.
const compactName = FileName + ".compact"

// Defaults of Options.
const (
	DefaultPreallocate   = 4 << 20
	DefaultCompactMin    = 4 << 20
	DefaultLockTimeout   = 10 * time.Second
	lockRetryInterval    = 50 * time.Millisecond
	quarantineFileSuffix = ".bin"
)

// Options tune a Store.
type Options struct {
	// Logger receives quarantine, recovery and commit logs; nil discards.
	Logger *slog.Logger
	// NoSync skips fsync and fdatasync (tests and benchmarks of the
	// non-durable path only).
	NoSync bool
	// OnQuarantine is called once per frame or damaged region Open moved
	// aside, with the record's key when it is known.
	OnQuarantine func(key string, err error)
	// Preallocate is how many bytes the log is extended by at a time
	// (zero-filled and synced ahead of the commits that use them);
	// 0 means DefaultPreallocate.
	Preallocate int64
	// CompactMin is how many dead bytes (replaced records and tombstones)
	// the log may hold before it is compacted, once they also outweigh the
	// live records; 0 means DefaultCompactMin.
	CompactMin int64
	// LockTimeout is how long Open waits for another process's lock on the
	// state directory; 0 means DefaultLockTimeout.
	LockTimeout time.Duration

	// beforeAppend, when set, runs before each commit's write: tests slow
	// the disk down with it to widen the window a kill can land in.
	beforeAppend func()
	// maxLinger, when set, replaces maxLinger (tests).
	maxLinger time.Duration
	// preallocate, when set, replaces the extension of a file's
	// zero-filled space (tests fail it, as a full disk would).
	preallocate func(f *os.File, off, n int64) error
	// beforeRename, when set, runs before a compaction renames its file
	// over the log; an error fails the compaction there (tests).
	beforeRename func() error
}

// Store is the durable record store.
type Store struct {
	dir  string
	opts Options
	log  *slog.Logger
	lock *os.File

	// Owned by the committer goroutine once Open returned.
	f      *os.File
	off    int64  // where the next frame goes
	alloc  int64  // bytes of the file zero-filled and synced
	failed error  // a failed write or sync: the file's state is unknown
	buf    []byte // the commit being written
	// compactAt is the dead bytes at which the next compaction is tried:
	// raised after a compaction failed before its rename (the log is
	// unchanged), so a full disk is not retried at every commit.
	compactAt int64

	mu        sync.RWMutex
	recs      map[string][]byte // key → JSON envelope of the live record
	liveBytes int64             // frame bytes of the live records

	reqs chan *writeReq
	done chan struct{}

	closeOnce sync.Once
	closeMu   sync.RWMutex // held (R) by writers enqueuing; (W) by Close
	closed    bool

	quarantined int
	compactions int
}

type writeReq struct {
	key  string
	body []byte // the JSON envelope of a put; nil for a delete
	err  chan error
}

// ErrClosed is returned by writes after Close.
var ErrClosed = errors.New("store is closed")

// ErrLocked is returned by Open when another process holds the state
// directory's lock.
var ErrLocked = errors.New("state dir is in use by another process")

// Open opens (creating if needed) the record log in dir: it takes the
// directory's lock, reads every frame (cutting a torn tail, quarantining
// damage and undecodable records), imports a bbolt agent.db, then starts
// the committer.
func Open(dir string, opts Options) (*Store, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Preallocate <= 0 {
		opts.Preallocate = DefaultPreallocate
	}
	if opts.CompactMin <= 0 {
		opts.CompactMin = DefaultCompactMin
	}
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = DefaultLockTimeout
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create state dir %q: %w", dir, err)
	}
	s := &Store{
		dir: dir, opts: opts, log: opts.Logger, recs: map[string][]byte{},
		reqs: make(chan *writeReq, 1024), done: make(chan struct{}),
	}
	lock, err := lockDir(dir, opts.LockTimeout)
	if err != nil {
		return nil, err
	}
	s.lock = lock
	if err := s.load(); err != nil {
		_ = s.closeFiles() // the load error is the one to report
		return nil, err
	}
	go s.commitLoop()
	return s, nil
}

// load reads the log, recovers it and imports a legacy database.
func (s *Store) load() error {
	if err := os.Remove(filepath.Join(s.dir, compactName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("failed to remove an unfinished compaction: %w", err)
	}
	path := filepath.Join(s.dir, FileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("failed to open store %q: %w", path, err)
	}
	s.f = f
	data, err := readAll(f)
	if err != nil {
		return fmt.Errorf("failed to read store %q: %w", path, err)
	}
	rewrite, err := s.recover(data)
	if err != nil {
		return err
	}
	imported, err := s.importLegacy()
	if err != nil {
		return err
	}
	if rewrite || imported {
		// A new log, damage moved aside or records imported: start from a
		// clean, synced log.
		if _, err := s.compact(); err != nil {
			return err
		}
	}
	if imported {
		return s.removeLegacy()
	}
	return nil
}

// recover replays data, the whole log, into the index. It returns true when
// the log must be rewritten (a new or damaged file). A torn tail is cut off
// and the space after the last frame zeroed before any write.
func (s *Store) recover(data []byte) (rewrite bool, err error) {
	if len(data) == 0 || (len(data) >= int(headerSize) && allZero(data[:headerSize])) {
		return true, nil // new, or created by a crash before its header was synced
	}
	if len(data) < int(headerSize) || string(data[:headerSize]) != fileMagic {
		return false, fmt.Errorf("failed to open store %q: it is not an agent record log (no %q header)", filepath.Join(s.dir, FileName), fileMagic[:len(fileMagic)-1])
	}
	off := headerSize
	for off < int64(len(data)) {
		kind, body, size, ferr := parseFrame(data[off:])
		if ferr == nil {
			s.replay(kind, body, size, off, &rewrite)
			off += size
			continue
		}
		next := resync(data[off:])
		if next < 0 {
			if tail := data[off:]; !allZero(tail) {
				// Cut by a crash: that commit was never acknowledged.
				s.log.Warn("cut the torn tail of the record log", "offset", off, "bytes", len(tail), "error", ferr.Error())
				if err := s.cutTail(off); err != nil {
					return false, err
				}
				data = data[:off]
			}
			break
		}
		derr := fmt.Errorf("damaged record log: %d bytes at offset %d do not hold an intact frame (%w); intact frames follow", next, off, ferr)
		s.quarantine("", data[off:off+next], derr)
		rewrite = true
		off += next
	}
	s.off = off
	s.alloc = int64(len(data))
	return rewrite, nil
}

// replay applies one intact frame to the index.
func (s *Store) replay(kind byte, body []byte, size, off int64, rewrite *bool) {
	switch kind {
	case kindDelete:
		s.remove(string(body))
	case kindPut:
		r, err := decodeEnvelope(body)
		if err != nil {
			s.quarantine("", body, fmt.Errorf("undecodable record at offset %d: %w", off, err))
			*rewrite = true
			return
		}
		s.set(r.Key(), append([]byte(nil), body...), size)
	}
}

// set makes body key's live record; callers hold mu or own the store.
func (s *Store) set(key string, body []byte, size int64) {
	if old, ok := s.recs[key]; ok {
		s.liveBytes -= frameSize(len(old))
	}
	s.recs[key] = body
	s.liveBytes += size
}

// remove drops key's live record; callers hold mu or own the store.
func (s *Store) remove(key string) {
	if old, ok := s.recs[key]; ok {
		s.liveBytes -= frameSize(len(old))
		delete(s.recs, key)
	}
}

// quarantine keeps b in the quarantine directory, counts it and logs it at
// ERROR. A failure to keep the bytes is logged; the record is lost either
// way, and the agent starts.
func (s *Store) quarantine(key string, b []byte, err error) {
	s.quarantined++
	name := fmt.Sprintf("%d-%d%s", time.Now().UnixNano(), s.quarantined, quarantineFileSuffix)
	qdir := filepath.Join(s.dir, QuarantineDir)
	path := filepath.Join(qdir, name)
	if werr := writeFileSynced(qdir, path, b, s.opts.NoSync); werr != nil {
		s.log.Error("failed to keep quarantined bytes", "path", path, "error", werr.Error())
	}
	s.log.Error("quarantined corrupt pod record", "container_id", key, "quarantine_file", path, "error", err.Error())
	if s.opts.OnQuarantine != nil {
		s.opts.OnQuarantine(key, err)
	}
}

// Quarantined returns how many frames or damaged regions Open moved aside.
func (s *Store) Quarantined() int { return s.quarantined }

// QuarantineCount returns how many files the quarantine directory holds
// (including those moved aside by earlier runs).
func (s *Store) QuarantineCount() (int, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, QuarantineDir))
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("failed to list the quarantine: %w", err)
	}
	return len(ents), nil
}

func (s *Store) commitLoop() {
	defer close(s.done)
	batch := make([]*writeReq, 0, maxBatch)
	var last gather // what the previous commit saw
	for first := range s.reqs {
		batch = append(batch[:0], first)
		batch = s.gather(batch, last)
		t0 := time.Now()
		queued := s.commit(batch)
		last = gather{writers: min(len(batch)+queued, maxBatch), sync: time.Since(t0)}
	}
}

// maxBatch bounds the records of one commit.
const maxBatch = 256

// gather is what one commit saw: the writers it answered plus those that
// queued while it synced (the writers active then), and how long its
// write and sync took.
type gather struct {
	writers int
	sync    time.Duration
}

// maxLinger bounds how long a commit waits for writers it expects.
const maxLinger = 100 * time.Microsecond

// gather adds the writers already queued to batch and, when fewer are
// queued than were active at the previous commit, yields to let the rest
// enqueue. Writers answered by a commit usually submit again at once, and
// a commit that starts before they do leaves them for the next one: eight
// writers then settle into two groups of four, each waiting for the
// other's sync, at half the records per sync. Counting the writers that
// queued during the previous sync as active too breaks that split (each
// group sees the other). The wait is at most half the previous commit's
// sync (and maxLinger), spinning on the scheduler rather than a
// timer (Go's timers cannot sleep a few microseconds), so it costs less
// than the sync it saves. A lone writer never waits.
func (s *Store) gather(batch []*writeReq, last gather) []*writeReq {
	batch = s.drain(batch)
	if len(batch) >= last.writers {
		return batch
	}
	limit := maxLinger
	if s.opts.maxLinger > 0 {
		limit = s.opts.maxLinger
	}
	linger := min(last.sync/2, limit)
	start := time.Now()
	for len(batch) < last.writers && len(batch) < cap(batch) {
		runtime.Gosched()
		n := len(batch)
		batch = s.drain(batch)
		if len(batch) == n && time.Since(start) >= linger {
			break
		}
	}
	return batch
}

// drain adds the requests queued now to batch, up to its capacity.
func (s *Store) drain(batch []*writeReq) []*writeReq {
	for len(batch) < cap(batch) {
		select {
		case r, ok := <-s.reqs:
			if !ok {
				return batch
			}
			batch = append(batch, r)
		default:
			return batch
		}
	}
	return batch
}

// commit writes batch as one write and one fdatasync, applies it to the
// index, answers every caller, then compacts if the dead frames call for it.
// It returns how many requests had queued by the time the sync ended.
func (s *Store) commit(batch []*writeReq) (queued int) {
	err := s.failed
	if err == nil {
		s.buf = s.buf[:0]
		for _, r := range batch {
			if r.body != nil {
				s.buf = appendFrame(s.buf, kindPut, r.body)
			} else {
				s.buf = appendFrame(s.buf, kindDelete, []byte(r.key))
			}
		}
		var extend bool
		if extend, err = s.append(s.buf); err != nil && !extend {
			// The file's state past the last sync is unknown (a failed
			// fsync may have dropped the pages): refuse every later write;
			// a restart reads back what is on disk.
			s.failed = fmt.Errorf("store failed, restart to recover: %w", err)
			s.log.Error("record log write failed; the store refuses writes until restarted", "error", err.Error())
		} else if err != nil {
			// Nothing of this commit was written (a full disk): fail its
			// callers, keep the store; the next commit tries again.
			s.log.Error("record log is out of space; this commit failed, the next one tries again", "error", err.Error())
		}
	}
	queued = len(s.reqs)
	if err == nil {
		s.mu.Lock()
		for _, r := range batch {
			if r.body != nil {
				s.set(r.key, r.body, frameSize(len(r.body)))
			} else {
				s.remove(r.key)
			}
		}
		s.mu.Unlock()
	}
	for _, r := range batch {
		if err != nil {
			r.err <- fmt.Errorf("failed to commit %d records: %w", len(batch), err)
		} else {
			r.err <- nil
		}
	}
	if err == nil && s.shouldCompact() {
		s.tryCompact()
	}
	return queued
}

// deadBytes is the frame bytes of replaced records and tombstones.
func (s *Store) deadBytes() int64 { return s.off - headerSize - s.liveBytes }

// shouldCompact is true when the dead bytes pass CompactMin (or the mark a
// failed compaction left) and outweigh the live records.
func (s *Store) shouldCompact() bool {
	dead := s.deadBytes()
	return dead >= max(s.opts.CompactMin, s.compactAt) && dead > s.liveBytes
}

// tryCompact compacts the log. A compaction that failed before its rename
// left the log as it was: the store goes on with it and tries again once
// another CompactMin of dead bytes has piled up. One that failed after it
// cannot tell which file a restart will find: the store refuses writes.
func (s *Store) tryCompact() {
	renamed, err := s.compact()
	switch {
	case err == nil:
		s.compactAt = 0
	case !renamed:
		s.compactAt = s.deadBytes() + s.opts.CompactMin
		s.log.Error("record log compaction failed; the log is unchanged and compaction is tried again later", "error", err.Error(), "retry_at_dead_bytes", s.compactAt)
	default:
		s.failed = fmt.Errorf("store failed, restart to recover: %w", err)
		s.log.Error("record log compaction failed after its rename; the store refuses writes until restarted", "error", err.Error())
	}
}

// compact writes the live records to a new log, syncs it, renames it over
// the log and syncs the directory. A crash before the rename leaves the old
// log (and a compact file Open removes); after it, the new one: either
// holds the same records. renamed says whether a failure came after the
// rename; one before it removes the compact file and leaves the log in use.
func (s *Store) compact() (renamed bool, err error) {
	keys := make([]string, 0, len(s.recs))
	for k := range s.recs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	buf := append(make([]byte, 0, headerSize+s.liveBytes), fileMagic...)
	for _, k := range keys {
		buf = appendFrame(buf, kindPut, s.recs[k])
	}
	path := filepath.Join(s.dir, compactName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return false, fmt.Errorf("failed to create %q: %w", path, err)
	}
	alloc := roundUp(int64(len(buf)), s.opts.Preallocate) + s.opts.Preallocate
	err = s.preallocate(f, 0, alloc)
	if err == nil {
		_, err = f.WriteAt(buf, 0)
	}
	if err == nil && !s.opts.NoSync {
		err = f.Sync()
	}
	if err == nil && s.opts.beforeRename != nil {
		err = s.opts.beforeRename()
	}
	if err == nil {
		err = os.Rename(path, filepath.Join(s.dir, FileName))
		if err != nil {
			err = fmt.Errorf("failed to rename the compacted log: %w", err)
		}
	}
	if err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return false, fmt.Errorf("failed to compact the record log: %w", err)
	}
	if !s.opts.NoSync {
		if err := syncDir(s.dir); err != nil {
			_ = f.Close()
			return true, fmt.Errorf("failed to compact the record log: %w", err)
		}
	}
	if s.f != nil {
		_ = s.f.Close()
	}
	s.f, s.off, s.alloc = f, int64(len(buf)), alloc
	s.compactions++
	s.log.Info("compacted the record log", "records", len(keys), "bytes", len(buf))
	return false, nil
}

// preallocate extends f's zero-filled space (Options.preallocate in tests).
func (s *Store) preallocate(f *os.File, off, n int64) error {
	if s.opts.preallocate != nil {
		return s.opts.preallocate(f, off, n)
	}
	return preallocate(f, off, n)
}

// append writes b at the log's end and syncs it, extending the zero-filled
// space first when b does not fit. extend says that an error came from
// that extension, before anything of b was written: the log holds what it
// held (only zeros past its end may have changed).
func (s *Store) append(b []byte) (extend bool, err error) {
	if s.opts.beforeAppend != nil {
		s.opts.beforeAppend()
	}
	if end := s.off + int64(len(b)); end > s.alloc {
		alloc := roundUp(end, s.opts.Preallocate) + s.opts.Preallocate
		if err := s.preallocate(s.f, s.alloc, alloc-s.alloc); err != nil {
			return true, fmt.Errorf("failed to extend the record log to %d bytes: %w", alloc, err)
		}
		if !s.opts.NoSync {
			// The new size and allocation, once, ahead of the commits.
			if err := s.f.Sync(); err != nil {
				return false, fmt.Errorf("failed to sync the extended record log: %w", err)
			}
		}
		s.alloc = alloc
	}
	if _, err := s.f.WriteAt(b, s.off); err != nil {
		return false, fmt.Errorf("failed to write %d bytes to the record log: %w", len(b), err)
	}
	if !s.opts.NoSync {
		if err := syncData(s.f); err != nil {
			return false, fmt.Errorf("failed to sync the record log: %w", err)
		}
	}
	s.off += int64(len(b))
	return false, nil
}

// cutTail zeroes the log from off to its end and syncs it, so no byte of a
// torn commit is ever read as a frame after later appends.
func (s *Store) cutTail(off int64) error {
	if err := s.f.Truncate(off); err != nil {
		return fmt.Errorf("failed to cut the record log at %d: %w", off, err)
	}
	if !s.opts.NoSync {
		if err := s.f.Sync(); err != nil {
			return fmt.Errorf("failed to sync the cut record log: %w", err)
		}
	}
	return nil
}

func (s *Store) submit(ctx context.Context, r *writeReq) error {
	if err := s.enqueue(ctx, r); err != nil {
		return err
	}
	// Once queued the write will commit; wait for it even if ctx ends so a
	// caller never reports failure for a write that became durable.
	return <-r.err
}

// enqueue hands r to the committer.
func (s *Store) enqueue(ctx context.Context, r *writeReq) error {
	s.closeMu.RLock()
	defer s.closeMu.RUnlock()
	if s.closed {
		return ErrClosed
	}
	r.err = make(chan error, 1)
	select {
	case s.reqs <- r:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Put durably stores r (replacing any record with the same key). It returns
// after the commit holding it has been synced to disk.
func (s *Store) Put(ctx context.Context, r *Record) error {
	return s.PutAsync(ctx, r)()
}

// PutAsync is Put in two halves: it encodes r, queues it for the next
// commit and returns; the returned wait blocks until that commit is on disk
// and returns what Put would. The caller can work while the commit syncs,
// but only wait's nil says r is durable. Call wait once.
func (s *Store) PutAsync(ctx context.Context, r *Record) (wait func() error) {
	body, err := encodeEnvelope(r)
	if err != nil {
		return func() error { return fmt.Errorf("failed to put record: %w", err) }
	}
	req := &writeReq{key: r.Key(), body: body}
	if err := s.enqueue(ctx, req); err != nil {
		return func() error { return err }
	}
	// Once queued the write will commit; wait for it even if ctx ends so a
	// caller never reports failure for a write that became durable.
	return func() error { return <-req.err }
}

// Delete durably removes the record with key; an unknown key is not an error.
func (s *Store) Delete(ctx context.Context, key string) error {
	if key == "" {
		return errors.New("failed to delete record: empty key")
	}
	return s.submit(ctx, &writeReq{key: key})
}

// Get returns the record with key, or nil when there is none.
func (s *Store) Get(key string) (*Record, error) {
	s.mu.RLock()
	body, ok := s.recs[key]
	s.mu.RUnlock()
	if !ok {
		return nil, nil
	}
	r, err := decodeEnvelope(body)
	if err != nil {
		return nil, fmt.Errorf("failed to read record %q: %w", key, err)
	}
	return r, nil
}

// List returns every record, sorted by key.
func (s *Store) List() ([]*Record, error) {
	s.mu.RLock()
	bodies := make([][]byte, 0, len(s.recs))
	for _, b := range s.recs {
		bodies = append(bodies, b)
	}
	s.mu.RUnlock()
	out := make([]*Record, 0, len(bodies))
	for _, b := range bodies {
		r, err := decodeEnvelope(b)
		if err != nil {
			return nil, fmt.Errorf("failed to list records: %w", err)
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key() < out[j].Key() })
	return out, nil
}

// Close stops accepting writes, commits what is queued and closes the log
// and the lock.
func (s *Store) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.closeMu.Lock()
		s.closed = true
		close(s.reqs)
		s.closeMu.Unlock()
		<-s.done
		err = s.closeFiles()
	})
	return err
}

// closeFiles closes the log, then releases the lock.
func (s *Store) closeFiles() error {
	var err error
	if s.f != nil {
		if cerr := s.f.Close(); cerr != nil {
			err = fmt.Errorf("failed to close the record log: %w", cerr)
		}
	}
	if s.lock != nil {
		_ = s.lock.Close() // closing the file releases the flock
	}
	return err
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }
