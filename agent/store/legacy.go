package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	bolt "go.etcd.io/bbolt"
)

// Buckets of the legacy bbolt database.
var (
	legacyBucketPods       = []byte("pods")
	legacyBucketQuarantine = []byte("quarantine")
)

// importLegacy moves the records of a bbolt agent.db into the index (the
// caller then writes and syncs them as a new log) and keeps the bytes of
// its quarantine bucket and of any record that does not decode in the
// quarantine directory. It returns false when there is no agent.db. The
// database is removed by removeLegacy once the new log is durable.
func (s *Store) importLegacy() (bool, error) {
	path := filepath.Join(s.dir, LegacyFileName)
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("failed to stat %q: %w", path, err)
	}
	// Read-only takes bbolt's shared flock: an older agent still holding
	// the database keeps this one out until the timeout.
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: s.opts.LockTimeout})
	if err != nil {
		return false, fmt.Errorf("failed to open the bbolt store %q to import it: %w", path, err)
	}
	defer func() { _ = db.Close() }() // read-only: nothing to flush
	// agent.db is the authority: a log beside it holds the same records
	// (an import cut before agent.db was removed) or older ones (written
	// before a downgrade to a bbolt agent).
	s.recs, s.liveBytes = map[string][]byte{}, 0
	n := 0
	err = db.View(func(tx *bolt.Tx) error {
		if q := tx.Bucket(legacyBucketQuarantine); q != nil {
			err := q.ForEach(func(k, v []byte) error {
				p := filepath.Join(s.dir, QuarantineDir, "bbolt-"+filepath.Base(string(k))+quarantineFileSuffix)
				if err := writeFileSynced(filepath.Dir(p), p, v, s.opts.NoSync); err != nil && !errors.Is(err, os.ErrExist) {
					return fmt.Errorf("failed to keep quarantined record %q: %w", k, err)
				}
				return nil
			})
			if err != nil {
				return err
			}
		}
		pods := tx.Bucket(legacyBucketPods)
		if pods == nil {
			return nil
		}
		return pods.ForEach(func(k, v []byte) error {
			r, derr := decodeBoltValue(v)
			if derr == nil && r.Key() != string(k) {
				derr = fmt.Errorf("record for container %q is stored under key %q", r.Key(), k)
			}
			if derr != nil {
				s.quarantine(string(k), v, fmt.Errorf("failed to import record %q: %w", k, derr))
				return nil
			}
			body := append([]byte(nil), v[4:]...)
			s.set(r.Key(), body, frameSize(len(body)))
			n++
			return nil
		})
	})
	if err != nil {
		return false, fmt.Errorf("failed to import the bbolt store %q: %w", path, err)
	}
	s.log.Info("imported the bbolt store into the record log", "path", path, "records", n)
	return true, nil
}

// removeLegacy removes agent.db once its records are durable in the log,
// and syncs the directory.
func (s *Store) removeLegacy() error {
	path := filepath.Join(s.dir, LegacyFileName)
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("failed to remove the imported bbolt store %q: %w", path, err)
	}
	if s.opts.NoSync {
		return nil
	}
	return syncDir(s.dir)
}
