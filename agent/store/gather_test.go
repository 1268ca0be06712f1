package store

import (
	"fmt"
	"testing"
	"time"
)

// gatherStore is a Store with only what gather reads: its queue and options.
func gatherStore(linger time.Duration) *Store {
	return &Store{reqs: make(chan *writeReq, 16), opts: Options{maxLinger: linger}}
}

func req(i int) *writeReq { return &writeReq{key: fmt.Sprintf("k%d", i)} }

// TestGatherWaitsForActiveWriters: writers that were active at the last
// commit but have not queued yet join this batch instead of the next one.
func TestGatherWaitsForActiveWriters(t *testing.T) {
	s := gatherStore(time.Minute)
	start := make(chan struct{})
	go func() {
		<-start
		s.reqs <- req(1)
		s.reqs <- req(2)
	}()
	close(start) // runnable, but not necessarily run before gather starts
	batch := s.gather(append(make([]*writeReq, 0, maxBatch), req(0)), gather{writers: 3, sync: time.Hour})
	if len(batch) != 3 {
		t.Fatalf("batch of %d, want the 3 active writers", len(batch))
	}
}

// TestGatherLoneWriterDoesNotWait: a commit that saw one writer commits
// what is queued at once; a writer that enqueues later goes in the next
// commit.
func TestGatherLoneWriterDoesNotWait(t *testing.T) {
	s := gatherStore(time.Minute)
	release := make(chan struct{})
	done := make(chan struct{})
	go func() {
		<-release
		s.reqs <- req(1)
		close(done)
	}()
	batch := s.gather(append(make([]*writeReq, 0, maxBatch), req(0)), gather{writers: 1, sync: time.Hour})
	close(release)
	<-done
	if len(batch) != 1 {
		t.Fatalf("batch of %d, want 1", len(batch))
	}
	if len(s.reqs) != 1 {
		t.Fatalf("%d requests left queued, want the late one", len(s.reqs))
	}
}

// TestGatherTakesWhatIsQueued: every queued request joins, even past the
// number expected, up to the batch's capacity.
func TestGatherTakesWhatIsQueued(t *testing.T) {
	s := gatherStore(time.Minute)
	for i := 1; i < 6; i++ {
		s.reqs <- req(i)
	}
	batch := make([]*writeReq, 0, 4)
	batch = s.gather(append(batch, req(0)), gather{writers: 1})
	if len(batch) != 4 || len(s.reqs) != 2 {
		t.Fatalf("batch of %d with %d left queued, want 4 and 2", len(batch), len(s.reqs))
	}
}

// TestGatherLingerIsBounded: writers expected but never coming delay the
// commit by the linger, not forever.
func TestGatherLingerIsBounded(t *testing.T) {
	s := gatherStore(time.Millisecond)
	batch := s.gather(append(make([]*writeReq, 0, maxBatch), req(0)), gather{writers: 8, sync: time.Hour})
	if len(batch) != 1 {
		t.Fatalf("batch of %d, want 1", len(batch))
	}
}
