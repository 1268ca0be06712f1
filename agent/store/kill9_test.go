package store

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// childDirEnv names the state dir of a store child process
// (TestKill9MidCommit); childRoundEnv its round, which prefixes its keys.
const (
	childDirEnv   = "AETHER_STORE_KILL9_DIR"
	childRoundEnv = "AETHER_STORE_KILL9_ROUND"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(childDirEnv); dir != "" {
		runChild(dir, os.Getenv(childRoundEnv))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild puts and deletes records from 8 goroutines until it is killed,
// syncing as the agent does, and writes one line per acknowledged write to
// stdout (two keys in three are deleted after their put): "P key" after a put's wait returned nil, "d key" before a delete
// is sent and "D key" after it returned nil. Small preallocation and
// compaction sizes make extensions and compactions happen between kills.
func runChild(dir, round string) {
	// A slow disk: up to 1 ms before each commit's write, so a kill often
	// lands between a commit's start and its write.
	slow := func() { time.Sleep(time.Duration(rand.IntN(1000)) * time.Microsecond) }
	s, err := Open(dir, Options{Preallocate: 16 << 10, CompactMin: 32 << 10, beforeAppend: slow})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	var mu sync.Mutex
	say := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		// One write per line, unbuffered: a line the parent reads was
		// written after the ack it reports.
		_, _ = os.Stdout.WriteString(fmt.Sprintf(format, args...) + "\n")
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				r := rec(i)
				r.Pod.ContainerId = fmt.Sprintf("r%s-g%d-%06d", round, g, i)
				r.Pod.Name = r.Pod.ContainerId
				if err := s.Put(ctx, r); err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(4)
				}
				say("P %s", r.Key())
				if i%3 != 2 { // two in three deleted: dead frames outweigh live ones, so it compacts
					say("d %s", r.Key())
					if err := s.Delete(ctx, r.Key()); err != nil {
						fmt.Fprintln(os.Stderr, err)
						os.Exit(4)
					}
					say("D %s", r.Key())
				}
			}
		}()
	}
	wg.Wait()
}

// TestKill9MidCommit runs a child process that writes with 8 goroutines,
// kills it with SIGKILL at a random point three times (each round opens the
// log the previous kill left), and checks after each kill that every
// acknowledged put is present (and whole), every acknowledged delete is
// absent, and nothing was quarantined. A store that answered before its
// write reached the file loses acknowledged records here.
func TestKill9MidCommit(t *testing.T) {
	dir := t.TempDir()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	put := map[string]bool{}     // acknowledged puts
	deleting := map[string]int{} // 1: delete sent, 2: acknowledged
	for round := 0; round < 3; round++ {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), childDirEnv+"="+dir, fmt.Sprintf("%s=%d", childRoundEnv, round))
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Kill once a random number of writes were acknowledged, at once:
		// the kill lands anywhere in the commits after that ack (the child
		// sleeps before each write), an extension or a compaction.
		killAt := 200 + rand.IntN(1500)
		acks := 0
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			op, key, ok := strings.Cut(sc.Text(), " ")
			if !ok {
				t.Fatalf("child wrote %q", sc.Text())
			}
			switch op {
			case "P":
				put[key] = true
			case "d":
				deleting[key] = 1
			case "D":
				deleting[key] = 2
			}
			if acks++; acks == killAt {
				if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("child ended with %v before it was killed", err)
		}

		s, err := Open(dir, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if s.Quarantined() != 0 {
			t.Errorf("round %d: quarantined %d after SIGKILL, want 0", round, s.Quarantined())
		}
		missing, resurrected := 0, 0
		for key := range put {
			r, err := s.Get(key)
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case deleting[key] == 2 && r != nil:
				resurrected++
			case deleting[key] == 0 && r == nil:
				missing++
			case r != nil && r.Pod.GetName() != key:
				t.Errorf("record %q holds pod %q", key, r.Pod.GetName())
			}
		}
		all, _ := s.List()
		t.Logf("round %d: killed after %d acks; %d acknowledged puts, %d records stored", round, killAt, len(put), len(all))
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if missing != 0 || resurrected != 0 {
			t.Fatalf("round %d: %d acknowledged puts missing, %d acknowledged deletes undone", round, missing, resurrected)
		}
	}
}
