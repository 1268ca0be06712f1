package harness

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
)

var (
	createdMu sync.Mutex
	created   []string // namespace paths this process made
)

func recordCreated(path string) {
	createdMu.Lock()
	created = append(created, path)
	createdMu.Unlock()
}

// leftovers returns the namespaces this process made that still exist, and
// those still mounted. Other test processes run in parallel, so only this
// process's own namespaces are judged.
func leftovers() (files, mounts []string) {
	createdMu.Lock()
	defer createdMu.Unlock()
	mounted := map[string]bool{}
	if f, err := os.Open("/proc/self/mountinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if fields := strings.Fields(sc.Text()); len(fields) > 4 {
				mounted[fields[4]] = true
			}
		}
		f.Close()
	}
	for _, p := range created {
		if _, err := os.Stat(p); err == nil {
			files = append(files, p)
		}
		if mounted[p] {
			mounts = append(mounts, p)
		}
	}
	return files, mounts
}

type snapshot struct {
	rootLinks []string // links in the root namespace named with NamePrefix
}

func takeSnapshot() snapshot {
	var s snapshot
	if links, err := netlinksafe.LinkList(); err == nil {
		for _, l := range links {
			if strings.HasPrefix(l.Attrs().Name, NamePrefix) {
				s.rootLinks = append(s.rootLinks, l.Attrs().Name)
			}
		}
	}
	return s
}

func added(before, after []string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) {
			out = append(out, a)
		}
	}
	return out
}

// Main runs the package's tests and then fails the run if a namespace, mount
// or root-namespace link made by the harness is left behind. Call it from
// TestMain: func TestMain(m *testing.M) { harness.Main(m) }.
func Main(m *testing.M) {
	root := os.Geteuid() == 0
	var before snapshot
	if root {
		before = takeSnapshot()
	}
	code := m.Run()
	CleanupOwn()
	if root {
		after := takeSnapshot()
		files, mounts := leftovers()
		leaks := map[string][]string{
			"network namespaces": files,
			"netns mounts":       mounts,
			"root-netns links":   added(before.rootLinks, after.rootLinks),
		}
		for what, l := range leaks {
			if len(l) > 0 {
				fmt.Fprintf(os.Stderr, "LEAK: tests left %d %s: %v\n", len(l), what, l)
				code = 1
			}
		}
	}
	os.Exit(code)
}
