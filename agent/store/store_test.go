package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
)

func rec(i int) *Record {
	return &Record{
		Pod: &cniv1.CNIPod{
			Name: fmt.Sprintf("p-%d", i), Namespace: "ns", ContainerId: fmt.Sprintf("c-%04d", i),
			NetworkNamespace: "/var/run/netns/x", Ips: []string{"10.0.0.1"}, Labels: map[string]string{"a": "b"}, Uid: "u",
		},
		Node: "n1", Owner: &registry.Owner{Kind: "ReplicaSet", Name: "rs"}, AddedAt: time.Unix(100, 0).UTC(),
		LastTimings: &cniv1.PluginTimings{Total: durationpb.New(time.Millisecond)}, Uncaptured: true, UncapturedError: "x",
		FixedName: i%2 == 0, Locality: registry.Locality{Region: "r1", Zone: fmt.Sprintf("z%d", i%3)},
		EnrolledVia: []string{"pod_label", "namespace_label", ""}[i%3],
	}
}

func equal(t *testing.T, got, want *Record) {
	t.Helper()
	if !proto.Equal(got.Pod, want.Pod) || !proto.Equal(got.LastTimings, want.LastTimings) || got.Node != want.Node ||
		*got.Owner != *want.Owner || !got.AddedAt.Equal(want.AddedAt) || got.Uncaptured != want.Uncaptured || got.UncapturedError != want.UncapturedError ||
		got.FixedName != want.FixedName || got.Locality != want.Locality || got.EnrolledVia != want.EnrolledVia {
		t.Fatalf("record = %+v, want %+v", got, want)
	}
}

func TestPutGetDeleteReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if err := s.Put(ctx, rec(i)); err != nil {
				t.Error(err)
			}
		}(i)
	}
	wg.Wait()
	if err := s.Delete(ctx, "c-0007"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "unknown"); err != nil {
		t.Fatalf("delete unknown: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(ctx, rec(1)); !errors.Is(err, ErrClosed) {
		t.Fatalf("put after close = %v, want ErrClosed", err)
	}
	s, err = Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	all, err := s.List()
	if err != nil || len(all) != 49 {
		t.Fatalf("List = %d records, %v; want 49", len(all), err)
	}
	got, err := s.Get("c-0003")
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, rec(3))
	if got, err := s.Get("c-0007"); got != nil || err != nil {
		t.Fatalf("deleted record = %v, %v", got, err)
	}
}

// TestLocalityOptional: a record without a locality is stored without the
// key (what an agent that predates it wrote) and decodes to the zero
// locality; one with a locality keeps it.
func TestLocalityOptional(t *testing.T) {
	for _, tc := range []struct {
		name    string
		loc     registry.Locality
		wantKey bool
	}{
		{name: "zero", loc: registry.Locality{}},
		{name: "region only", loc: registry.Locality{Region: "r1"}, wantKey: true},
		{name: "full", loc: registry.Locality{Region: "r1", Zone: "z1", Subzone: "s1"}, wantKey: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rec(1)
			r.Locality = tc.loc
			b, err := encodeEnvelope(r)
			if err != nil {
				t.Fatal(err)
			}
			if has := strings.Contains(string(b), `"locality"`); has != tc.wantKey {
				t.Fatalf("encoded %s: has the locality key %v, want %v", b, has, tc.wantKey)
			}
			got, err := decodeEnvelope(b)
			if err != nil {
				t.Fatal(err)
			}
			equal(t, got, r)
		})
	}
}

// TestPutAsync: wait answers as Put would, and a record is readable (and
// survives a reopen) once wait returned nil; a caller's later change to the
// record does not reach the store.
func TestPutAsync(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tests := []struct {
		name    string
		rec     *Record
		wantErr bool
	}{
		{name: "record", rec: rec(1)},
		{name: "no pod", rec: &Record{}, wantErr: true},
		{name: "no container id", rec: &Record{Pod: &cniv1.CNIPod{Name: "p"}}, wantErr: true},
	}
	for _, tt := range tests {
		wait := s.PutAsync(ctx, tt.rec)
		if tt.rec.Pod != nil {
			tt.rec.Pod.Name = "changed after PutAsync"
		}
		if err := wait(); (err != nil) != tt.wantErr {
			t.Fatalf("%s: wait() = %v, want error %v", tt.name, err, tt.wantErr)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.PutAsync(ctx, rec(2))(); !errors.Is(err, ErrClosed) {
		t.Fatalf("PutAsync after Close: %v, want ErrClosed", err)
	}
	s, err = Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	got, err := s.Get(rec(1).Key())
	if err != nil || got == nil {
		t.Fatalf("Get after reopen = %v, %v", got, err)
	}
	equal(t, got, rec(1))
}
