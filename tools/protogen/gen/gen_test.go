package gen

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
)

const moduleRoot = "../../.."

func compileAPI(t *testing.T) map[string][]protoreflect.FileDescriptor {
	t.Helper()
	_, fds := compileFiles(t)
	return byPackage(fds)
}

// compileFiles compiles every .proto under api/ and returns their paths and
// descriptors.
func compileFiles(t *testing.T) ([]string, []protoreflect.FileDescriptor) {
	t.Helper()
	root := filepath.Join(moduleRoot, "api")
	files, err := findProtos(root)
	if err != nil {
		t.Fatal(err)
	}
	fds, err := Compile(context.Background(), root, files)
	if err != nil {
		t.Fatal(err)
	}
	return files, fds
}

// TestDocsAreCurrent renders the reference and compares it with docs/api, so
// a .proto change without `make generate` fails here as well as in CI.
func TestDocsAreCurrent(t *testing.T) {
	for pkg, fds := range compileAPI(t) {
		want := RenderMarkdown(pkg, fds)
		got, err := os.ReadFile(filepath.Join(moduleRoot, "docs", "api", pkg+".md"))
		if err != nil {
			t.Fatalf("docs for %s missing (run make generate): %v", pkg, err)
		}
		if string(got) != want {
			t.Errorf("docs/api/%s.md is stale: run make generate", pkg)
		}
	}
}

// TestDocsListEveryField checks every field, enum value and RPC appears in
// the rendered reference, with its number and its constraints.
func TestDocsListEveryField(t *testing.T) {
	for pkg, fds := range compileAPI(t) {
		doc := RenderMarkdown(pkg, fds)
		var msgs []protoreflect.MessageDescriptor
		var enums []protoreflect.EnumDescriptor
		for _, fd := range fds {
			collect(fd.Messages(), fd.Enums(), &msgs, &enums)
			for i := range fd.Services().Len() {
				ms := fd.Services().Get(i).Methods()
				for j := range ms.Len() {
					if !strings.Contains(doc, "| `"+string(ms.Get(j).Name())+"` |") {
						t.Errorf("%s: RPC %s missing", pkg, ms.Get(j).Name())
					}
				}
			}
		}
		for _, md := range msgs {
			fields := md.Fields()
			for i := range fields.Len() {
				f := fields.Get(i)
				row := "| `" + string(f.Name()) + "` | " + strconv.Itoa(int(f.Number())) + " |"
				if !strings.Contains(doc, row) {
					t.Errorf("%s: field %s.%s missing", pkg, md.Name(), f.Name())
				}
			}
		}
		for _, ed := range enums {
			vs := ed.Values()
			for i := range vs.Len() {
				if !strings.Contains(doc, "| `"+string(vs.Get(i).Name())+"` | "+strconv.Itoa(int(vs.Get(i).Number()))+" |") {
					t.Errorf("%s: enum value %s.%s missing", pkg, ed.Name(), vs.Get(i).Name())
				}
			}
		}
	}
}

func TestConstraintsRendered(t *testing.T) {
	doc := RenderMarkdown("aether.cni.v1", compileAPI(t)["aether.cni.v1"])
	for _, want := range []string{
		`string.prefix = "/"`,
		"repeated.items.string.ip = true",
		"required = true",
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("constraint %q not rendered", want)
		}
	}
}

// TestOptionOnlyImports: an import that only options use (buf/validate in the
// CNI API) reaches the plugins as an option import, so the generated Go does
// not import its package; imports whose types a field, a method or an
// extension names stay imports. Files that are only dependencies are sent
// unchanged.
func TestOptionOnlyImports(t *testing.T) {
	files, fds := compileFiles(t)
	byName := map[string]*descriptorpb.FileDescriptorProto{}
	for _, fdp := range buildRequest(fds, files, "aether.io/node/api").GetProtoFile() {
		byName[fdp.GetName()] = fdp
	}
	for _, tc := range []struct {
		file          string
		deps, options []string
	}{
		{
			file:    "aether/cni/v1/cni.proto",
			deps:    []string{"google/protobuf/duration.proto", "google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"},
			options: []string{"buf/validate/validate.proto"},
		},
		{file: "istio/workload/discovery.proto", deps: []string{"envoy/config/core/v3/config_source.proto"}},
		// not generated here: left as compiled.
		{file: "buf/validate/validate.proto", deps: []string{"google/protobuf/descriptor.proto", "google/protobuf/duration.proto", "google/protobuf/field_mask.proto", "google/protobuf/timestamp.proto"}},
	} {
		fdp := byName[tc.file]
		if fdp == nil {
			t.Fatalf("%s not in the request", tc.file)
		}
		if !slices.Equal(fdp.GetDependency(), tc.deps) || !slices.Equal(fdp.GetOptionDependency(), tc.options) {
			t.Errorf("%s: imports %q, option imports %q; want %q, %q", tc.file, fdp.GetDependency(), fdp.GetOptionDependency(), tc.deps, tc.options)
		}
	}
}
