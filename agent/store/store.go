// Package store keeps the agent's durable pod records in a bbolt database
// under the state directory: one record per sandbox (container) ID, holding
// everything needed to rebuild the pod's endpoint and xDS resources without
// the API server.
//
// Writes from concurrent callers share commits (group commit): one goroutine
// owns the write transaction and folds every request queued while the
// previous commit was syncing into the next one, so eight concurrent AddPods
// cost about one fsync, not eight, and a lone writer waits for no timer.
//
// Each value is framed with a CRC-32C checksum. On Open every record is
// decoded; a record that does not decode is moved to the quarantine bucket,
// counted and logged, and never stops the agent.
package store

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/encoding/protojson"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
)

// FileName is the database file inside the state directory.
const FileName = "agent.db"

var (
	bucketPods       = []byte("pods")
	bucketQuarantine = []byte("quarantine")
	castagnoli       = crc32.MakeTable(crc32.Castagnoli)
)

// recordVersion is the envelope version written by this code.
const recordVersion = 1

// Record is one stored pod sandbox.
type Record struct {
	// Pod is the CNIPod as the agent completed it on AddPod (identity, IPs,
	// netns, labels, annotations, uid, service account, volumes, terminating).
	Pod *cniv1.CNIPod
	// Node is the node the pod runs on.
	Node string
	// Owner is the pod's controlling owner reference, if any.
	Owner *registry.Owner
	// HostNetwork is true for host-network pods.
	HostNetwork bool
	// FixedName is true when the pod's name was not generated
	// (podsource.Pod.FixedName); false on records written before it existed,
	// which the workload builder then treats as generated (as every
	// controller-created pod is).
	FixedName bool
	// Uncaptured is true when the last ReportAddResult carried a
	// capture_divert_error: the pod runs without the mesh.
	Uncaptured bool
	// UncapturedError is that capture_divert_error.
	UncapturedError string
	// LastTimings are the plugin's timings of the last ADD, if any: those of
	// AddPod (started, pre_call), replaced by ReportAddResult's (every field).
	LastTimings *cniv1.PluginTimings
	// AddedAt is when AddPod first stored the record.
	AddedAt time.Time
	// Locality is the node's topology when the agent last wrote the record
	// knowing it (read from its Node): what the pod's endpoint and WDS
	// workload carry while a restarted agent cannot read its Node (the API
	// server down). Zero on records written before it existed.
	Locality registry.Locality
}

// Key returns the record's key: the sandbox (container) ID.
func (r *Record) Key() string { return r.Pod.GetContainerId() }

// Clone returns a deep copy.
func (r *Record) Clone() *Record {
	if r == nil {
		return nil
	}
	c := *r
	if r.Pod != nil {
		c.Pod = cloneProto(r.Pod)
	}
	if r.LastTimings != nil {
		c.LastTimings = cloneProto(r.LastTimings)
	}
	if r.Owner != nil {
		o := *r.Owner
		c.Owner = &o
	}
	return &c
}

type envelope struct {
	Version         int             `json:"v"`
	Pod             json.RawMessage `json:"pod"`
	Node            string          `json:"node,omitempty"`
	Owner           *registry.Owner `json:"owner,omitempty"`
	HostNetwork     bool            `json:"host_network,omitempty"`
	FixedName       bool            `json:"fixed_name,omitempty"`
	Uncaptured      bool            `json:"uncaptured,omitempty"`
	UncapturedError string          `json:"uncaptured_error,omitempty"`
	LastTimings     json.RawMessage `json:"last_timings,omitempty"`
	AddedAt         time.Time       `json:"added_at"`
	// Locality is omitted when zero; an agent that predates it ignores it.
	Locality *registry.Locality `json:"locality,omitempty"`
}

// Encode frames r as stored on disk: 4 bytes CRC-32C (big endian) of the
// JSON envelope that follows.
func Encode(r *Record) ([]byte, error) {
	if r == nil || r.Pod == nil || r.Pod.GetContainerId() == "" {
		return nil, errors.New("failed to encode record: a record needs a pod with a container_id")
	}
	pod, err := protojson.Marshal(r.Pod)
	if err != nil {
		return nil, fmt.Errorf("failed to encode pod %q: %w", r.Pod.GetContainerId(), err)
	}
	env := envelope{
		Version: recordVersion, Pod: pod, Node: r.Node, Owner: r.Owner, HostNetwork: r.HostNetwork, FixedName: r.FixedName,
		Uncaptured: r.Uncaptured, UncapturedError: r.UncapturedError, AddedAt: r.AddedAt.UTC(),
	}
	if r.Locality != (registry.Locality{}) {
		l := r.Locality
		env.Locality = &l
	}
	if r.LastTimings != nil {
		if env.LastTimings, err = protojson.Marshal(r.LastTimings); err != nil {
			return nil, fmt.Errorf("failed to encode timings of %q: %w", r.Pod.GetContainerId(), err)
		}
	}
	body, err := json.Marshal(&env)
	if err != nil {
		return nil, fmt.Errorf("failed to encode record %q: %w", r.Pod.GetContainerId(), err)
	}
	out := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(out, crc32.Checksum(body, castagnoli))
	copy(out[4:], body)
	return out, nil
}

// Decode parses a stored value. It fails on a bad checksum, an unknown
// version, or a pod without a container ID.
func Decode(b []byte) (*Record, error) {
	if len(b) < 4 {
		return nil, fmt.Errorf("failed to decode record: %d bytes is shorter than the 4-byte checksum", len(b))
	}
	body := b[4:]
	if got, want := crc32.Checksum(body, castagnoli), binary.BigEndian.Uint32(b); got != want {
		return nil, fmt.Errorf("failed to decode record: checksum %08x does not match stored %08x", got, want)
	}
	var env envelope
	if err := json.Unmarshal(body, &env); err != nil {
		return nil, fmt.Errorf("failed to decode record envelope: %w", err)
	}
	if env.Version != recordVersion {
		return nil, fmt.Errorf("failed to decode record: version %d, this agent reads version %d", env.Version, recordVersion)
	}
	r := &Record{
		Pod: &cniv1.CNIPod{}, Node: env.Node, Owner: env.Owner, HostNetwork: env.HostNetwork, FixedName: env.FixedName,
		Uncaptured: env.Uncaptured, UncapturedError: env.UncapturedError, AddedAt: env.AddedAt,
	}
	if env.Locality != nil {
		r.Locality = *env.Locality
	}
	opts := protojson.UnmarshalOptions{DiscardUnknown: true}
	if err := opts.Unmarshal(env.Pod, r.Pod); err != nil {
		return nil, fmt.Errorf("failed to decode record pod: %w", err)
	}
	if r.Pod.GetContainerId() == "" {
		return nil, errors.New("failed to decode record: pod has no container_id")
	}
	if len(env.LastTimings) > 0 {
		r.LastTimings = &cniv1.PluginTimings{}
		if err := opts.Unmarshal(env.LastTimings, r.LastTimings); err != nil {
			return nil, fmt.Errorf("failed to decode record timings: %w", err)
		}
	}
	return r, nil
}

// Options tune a Store.
type Options struct {
	// Logger receives quarantine and commit logs; nil discards.
	Logger *slog.Logger
	// NoSync skips fsync (tests and benchmarks of the non-durable path only).
	NoSync bool
	// OnQuarantine is called once per record moved aside on Open.
	OnQuarantine func(key string, err error)
}

// Store is the durable record store.
type Store struct {
	db   *bolt.DB
	log  *slog.Logger
	reqs chan *writeReq
	done chan struct{}

	closeOnce sync.Once
	closeMu   sync.RWMutex // held (R) by writers enqueuing; (W) by Close
	closed    bool

	quarantined int
}

type writeReq struct {
	put *Record
	del string
	err chan error
}

// ErrClosed is returned by writes after Close.
var ErrClosed = errors.New("store is closed")

// Open opens (creating if needed) the database in dir, checks every record
// and quarantines the ones that do not decode, then starts the committer.
func Open(dir string, opts Options) (*Store, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create state dir %q: %w", dir, err)
	}
	path := filepath.Join(dir, FileName)
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Second, NoSync: opts.NoSync, NoFreelistSync: true, FreelistType: bolt.FreelistMapType})
	if err != nil {
		return nil, fmt.Errorf("failed to open store %q: %w", path, err)
	}
	s := &Store{db: db, log: log, reqs: make(chan *writeReq, 1024), done: make(chan struct{})}
	if err := s.check(opts.OnQuarantine); err != nil {
		_ = db.Close()
		return nil, err
	}
	go s.commitLoop()
	return s, nil
}

// check creates the buckets and moves undecodable records to quarantine.
func (s *Store) check(onQ func(string, error)) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		pods, err := tx.CreateBucketIfNotExists(bucketPods)
		if err != nil {
			return fmt.Errorf("failed to create bucket %q: %w", bucketPods, err)
		}
		q, err := tx.CreateBucketIfNotExists(bucketQuarantine)
		if err != nil {
			return fmt.Errorf("failed to create bucket %q: %w", bucketQuarantine, err)
		}
		type bad struct {
			k, v []byte
			err  error
		}
		var bads []bad
		err = pods.ForEach(func(k, v []byte) error {
			r, derr := Decode(v)
			if derr == nil && r.Key() != string(k) {
				derr = fmt.Errorf("record for container %q is stored under key %q", r.Key(), k)
			}
			if derr != nil {
				bads = append(bads, bad{append([]byte(nil), k...), append([]byte(nil), v...), derr})
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("failed to scan records: %w", err)
		}
		for _, b := range bads {
			qk := fmt.Appendf(nil, "%s@%d", b.k, time.Now().UnixNano())
			if err := q.Put(qk, b.v); err != nil {
				return fmt.Errorf("failed to quarantine record %q: %w", b.k, err)
			}
			if err := pods.Delete(b.k); err != nil {
				return fmt.Errorf("failed to remove corrupt record %q: %w", b.k, err)
			}
			s.quarantined++
			s.log.Error("quarantined corrupt pod record", "container_id", string(b.k), "quarantine_key", string(qk), "error", b.err.Error())
			if onQ != nil {
				onQ(string(b.k), b.err)
			}
		}
		return nil
	})
}

// Quarantined returns how many records Open moved aside.
func (s *Store) Quarantined() int { return s.quarantined }

// QuarantineCount returns how many records the quarantine bucket holds
// (including those moved aside by earlier runs).
func (s *Store) QuarantineCount() (int, error) {
	n := 0
	err := s.db.View(func(tx *bolt.Tx) error {
		n = tx.Bucket(bucketQuarantine).Stats().KeyN
		return nil
	})
	return n, err
}

func (s *Store) commitLoop() {
	defer close(s.done)
	batch := make([]*writeReq, 0, 64)
	for first := range s.reqs {
		batch = append(batch[:0], first)
		// Writers answered by the previous commit are usually about to
		// enqueue again: yield once so they join this batch instead of
		// trailing into the next one. No timer, so a lone writer pays
		// only a scheduler round trip.
		for round := 0; round < 2 && len(batch) < cap(batch); round++ {
			if round == 1 {
				runtime.Gosched()
			}
		drain:
			for len(batch) < cap(batch) {
				select {
				case r, ok := <-s.reqs:
					if !ok {
						break drain
					}
					batch = append(batch, r)
				default:
					break drain
				}
			}
		}
		s.commit(batch)
	}
}

func (s *Store) commit(batch []*writeReq) {
	results := make([]error, len(batch))
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPods)
		for i, r := range batch {
			if r.put != nil {
				v, err := Encode(r.put)
				if err != nil {
					results[i] = err
					continue
				}
				if err := b.Put([]byte(r.put.Key()), v); err != nil {
					return fmt.Errorf("failed to put record %q: %w", r.put.Key(), err)
				}
			} else if err := b.Delete([]byte(r.del)); err != nil {
				return fmt.Errorf("failed to delete record %q: %w", r.del, err)
			}
		}
		return nil
	})
	for i, r := range batch {
		if err != nil {
			r.err <- fmt.Errorf("failed to commit %d records: %w", len(batch), err)
		} else {
			r.err <- results[i]
		}
	}
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

// PutAsync is Put in two halves: it queues r for the next commit and
// returns at once; the returned wait blocks until that commit is on disk
// and returns what Put would. The caller can work while the commit syncs,
// but only wait's nil says r is durable. Call wait once.
func (s *Store) PutAsync(ctx context.Context, r *Record) (wait func() error) {
	if r == nil || r.Pod == nil || r.Pod.GetContainerId() == "" {
		return func() error { return errors.New("failed to put record: a record needs a pod with a container_id") }
	}
	req := &writeReq{put: r.Clone()}
	if err := s.enqueue(ctx, req); err != nil {
		return func() error { return err }
	}
	// Once queued the write will commit; wait for it even if ctx ends so a
	// caller never reports failure for a write that became durable.
	return func() error { return <-req.err }
}

// Delete durably removes the record with key; an unknown key is not an error.
func (s *Store) Delete(ctx context.Context, key string) error {
	return s.submit(ctx, &writeReq{del: key})
}

// Get returns the record with key, or nil when there is none.
func (s *Store) Get(key string) (*Record, error) {
	var r *Record
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketPods).Get([]byte(key))
		if v == nil {
			return nil
		}
		var err error
		r, err = Decode(v)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("failed to read record %q: %w", key, err)
	}
	return r, nil
}

// List returns every record, sorted by key. Records that fail to decode
// (only possible if the file is damaged while running) are skipped and
// logged.
func (s *Store) List() ([]*Record, error) {
	var out []*Record
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketPods).ForEach(func(k, v []byte) error {
			r, err := Decode(v)
			if err != nil {
				s.log.Error("skipped undecodable pod record", "container_id", string(k), "error", err.Error())
				return nil
			}
			out = append(out, r)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("failed to list records: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key() < out[j].Key() })
	return out, nil
}

// Close stops accepting writes, commits what is queued and closes the
// database.
func (s *Store) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.closeMu.Lock()
		s.closed = true
		close(s.reqs)
		s.closeMu.Unlock()
		<-s.done
		err = s.db.Close()
	})
	return err
}
