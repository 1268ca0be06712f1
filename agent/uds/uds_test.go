package uds

import (
	"errors"
	"strings"
	"testing"

	cniv1 "aether.io/node/api/aether/cni/v1"
)

func pod(ann string, csi string, n uint32, vols ...string) *cniv1.CNIPod {
	p := &cniv1.CNIPod{Namespace: "ns", Name: "p", Uid: "1234-abcd", UdsCsiVolume: csi, UdsCsiVolumes: n, Volumes: vols}
	if ann != "" {
		p.Annotations = map[string]string{Annotation: ann}
	}
	return p
}

func TestResolve(t *testing.T) {
	long := strings.Repeat("x", 100)
	for _, tc := range []struct {
		name   string
		root   string
		pod    *cniv1.CNIPod
		want   string
		asked  bool
		reason string
	}{
		{"not asked", "/run/aether/uds", pod("", "mesh", 1, "mesh"), "", false, ""},
		{"ok", "/run/aether/uds", pod("mesh/app.sock", "mesh", 1, "mesh", "data"), "/run/aether/uds/1234-abcd/app.sock", true, ""},
		{"emptyDir volume", "/run/aether/uds", pod("data/app.sock", "mesh", 1, "mesh", "data"), "", true, ReasonNotCSI},
		{"undeclared", "/run/aether/uds", pod("other/app.sock", "mesh", 1, "mesh"), "", true, ReasonVolumeNotDeclared},
		{"no csi at all, declared", "/run/aether/uds", pod("data/app.sock", "", 0, "data"), "", true, ReasonNotCSI},
		{"two csi volumes", "/run/aether/uds", pod("mesh/app.sock", "", 2, "mesh", "mesh2"), "", true, ReasonMultipleCSIVolumes},
		{"dotdot file", "/run/aether/uds", pod("mesh/..", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"dot volume", "/run/aether/uds", pod("./app.sock", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"nested file", "/run/aether/uds", pod("mesh/a/b", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"nul", "/run/aether/uds", pod("mesh/a\x00b", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"no slash", "/run/aether/uds", pod("mesh", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"empty file", "/run/aether/uds", pod("mesh/", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"too long for sun_path", "/run/aether/uds", pod("mesh/"+long, "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
		{"relative root", "run/uds", pod("mesh/a.sock", "mesh", 1, "mesh"), "", true, ReasonInvalidPath},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, asked, err := Resolve(tc.root, tc.pod)
			if asked != tc.asked || got != tc.want {
				t.Fatalf("Resolve = %q, %v, %v; want %q, %v", got, asked, err, tc.want, tc.asked)
			}
			var re *RefusalError
			switch {
			case tc.reason == "" && err != nil:
				t.Fatalf("unexpected error %v", err)
			case tc.reason != "" && (!errors.As(err, &re) || re.Reason != tc.reason):
				t.Fatalf("error %v, want reason %s", err, tc.reason)
			}
		})
	}
	// Missing uid (records written before the field existed).
	p := pod("mesh/a.sock", "mesh", 1, "mesh")
	p.Uid = ""
	var re *RefusalError
	if _, _, err := Resolve("/r", p); !errors.As(err, &re) || re.Reason != ReasonMissingUID {
		t.Fatalf("missing uid: %v", err)
	}
}

// FuzzResolve: whatever the annotation, a resolved path is
// <root>/<uid>/<single segment>, within the sun_path limit.
func FuzzResolve(f *testing.F) {
	for _, s := range []string{"mesh/app.sock", "mesh/..", "../x", "mesh/a/b", "mesh/\x00", "/", "mesh/" + strings.Repeat("y", 200), "mesh//x"} {
		f.Add(s, "1234")
	}
	f.Fuzz(func(t *testing.T, ann, uid string) {
		p := pod(ann, "mesh", 1, "mesh", "data")
		p.Uid = uid
		const root = "/run/aether/uds"
		got, asked, err := Resolve(root, p)
		if !asked {
			t.Fatal("annotation present but not asked")
		}
		if err != nil {
			var re *RefusalError
			if !errors.As(err, &re) || got != "" {
				t.Fatalf("error %v with path %q", err, got)
			}
			return
		}
		rest, ok := strings.CutPrefix(got, root+"/"+uid+"/")
		if !ok || !ValidSegment(rest) || !ValidSegment(uid) || len(got) > MaxSunPath || !strings.HasPrefix(ann, "mesh/") {
			t.Fatalf("Resolve(%q, uid %q) = %q: not <root>/<uid>/<segment> within %d bytes", ann, uid, got, MaxSunPath)
		}
	})
}
