package ctl

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"aether.io/node/pkg/adminapi"
)

// TestRunPodsEnrolment: the table names the label that enrolled each pod,
// at its ADD, and since when; "-" from an agent that does not say.
func TestRunPodsEnrolment(t *testing.T) {
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	sock := serveAdmin(t, []adminapi.Pod{
		{Namespace: "shop", Name: "web-1", ContainerID: "c1", Managed: true, AddedAt: at, EnrolledVia: "namespace_label"},
		{Namespace: "shop", Name: "db-1", ContainerID: "c2", Managed: true, AddedAt: at.Add(time.Hour), EnrolledVia: "pod_label"},
		{Namespace: "mesh", Name: "old-1", ContainerID: "c3", Managed: true, AddedAt: at},
	}, nil)
	var out bytes.Buffer
	if err := RunPods(context.Background(), []string{"--admin-socket", sock}, &out); err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		"web-1": {"namespace label, at ADD", "2026-11-30T10:00:00Z"},
		"db-1":  {"pod label, at ADD", "2026-11-30T11:00:00Z"},
		"old-1": {" - ", "2026-11-30T10:00:00Z"},
	}
	lines := strings.Split(out.String(), "\n")
	if !strings.Contains(lines[0], "ENROLLED") || !strings.Contains(lines[0], "SINCE") {
		t.Fatalf("header %q lacks ENROLLED and SINCE", lines[0])
	}
	for name, cells := range want {
		found := false
		for _, l := range lines {
			if !strings.Contains(l, " "+name+" ") {
				continue
			}
			found = true
			for _, c := range cells {
				if !strings.Contains(l, c) {
					t.Errorf("row of %s %q lacks %q", name, l, c)
				}
			}
		}
		if !found {
			t.Errorf("no row for %s in:\n%s", name, out.String())
		}
	}
}
