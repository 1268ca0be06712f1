// Package gen compiles the project's .proto files with protocompile, resolving
// imports that are not in the tree from the Go-registered descriptors, and
// drives protoc-gen-go and protoc-gen-go-grpc over them as protoc would, with
// one difference: an import that only options use is sent as an option import
// (see asOptionImports), so the generated Go does not link it.
package gen

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/pluginpb"

	// Registered descriptors that the .proto files may import.
	_ "buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	_ "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	_ "google.golang.org/protobuf/types/known/durationpb"
	_ "google.golang.org/protobuf/types/known/timestamppb"
	_ "google.golang.org/protobuf/types/known/wrapperspb"
)

// Config says where the inputs and outputs are.
type Config struct {
	// ProtoRoot holds the .proto files; it is the import root and the output
	// root of the Go code.
	ProtoRoot string
	// GoModule is the Go import path of ProtoRoot: a file's Go code goes to
	// its go_package with this prefix taken off, under ProtoRoot (protoc's
	// module= option), so a .proto can generate into another directory than
	// its own (the CNI service's gRPC stubs, apart from its messages).
	GoModule string
	// DocsDir receives one Markdown file per proto package.
	DocsDir string
	// GoPlugin and GRPCPlugin are the plugin binaries.
	GoPlugin, GRPCPlugin string
}

// Run compiles every .proto under cfg.ProtoRoot and writes Go code and docs.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	files, err := findProtos(cfg.ProtoRoot)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no .proto files under %q", cfg.ProtoRoot)
	}
	compiled, err := Compile(ctx, cfg.ProtoRoot, files)
	if err != nil {
		return err
	}
	req := buildRequest(compiled, files, cfg.GoModule)
	for _, plugin := range []string{cfg.GoPlugin, cfg.GRPCPlugin} {
		n, err := runPlugin(ctx, plugin, req, cfg.ProtoRoot)
		if err != nil {
			return err
		}
		log.Info("generated", "plugin", filepath.Base(plugin), "files", n)
	}
	if err := os.MkdirAll(cfg.DocsDir, 0o755); err != nil {
		return fmt.Errorf("failed to create docs dir %q: %w", cfg.DocsDir, err)
	}
	for pkg, fds := range byPackage(compiled) {
		out := filepath.Join(cfg.DocsDir, pkg+".md")
		if err := os.WriteFile(out, []byte(RenderMarkdown(pkg, fds)), 0o644); err != nil {
			return fmt.Errorf("failed to write %q: %w", out, err)
		}
		log.Info("rendered", "doc", out)
	}
	return nil
}

func findProtos(root string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".proto") {
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("failed to list .proto files under %q: %w", root, err)
	}
	slices.Sort(files)
	return files, nil
}

// Compile compiles the named files (relative to root). Imports not found under
// root come from protoregistry.GlobalFiles.
func Compile(ctx context.Context, root string, files []string) ([]protoreflect.FileDescriptor, error) {
	registered := protocompile.ResolverFunc(func(path string) (protocompile.SearchResult, error) {
		fd, err := protoregistry.GlobalFiles.FindFileByPath(path)
		if err != nil {
			return protocompile.SearchResult{}, fmt.Errorf("import %q is neither under %q nor registered by a linked Go package: %w", path, root, err)
		}
		return protocompile.SearchResult{Desc: fd}, nil
	})
	c := protocompile.Compiler{
		Resolver: protocompile.CompositeResolver{
			&protocompile.SourceResolver{ImportPaths: []string{root}},
			registered,
		},
		SourceInfoMode: protocompile.SourceInfoStandard,
	}
	res, err := c.Compile(ctx, files...)
	if err != nil {
		return nil, fmt.Errorf("failed to compile protos: %w", err)
	}
	out := make([]protoreflect.FileDescriptor, 0, len(res))
	for _, f := range res {
		out = append(out, f)
	}
	return out, nil
}

// buildRequest lists every file in dependency order, as protoc does; Go code
// goes to each file's go_package relative to goModule.
func buildRequest(compiled []protoreflect.FileDescriptor, toGenerate []string, goModule string) *pluginpb.CodeGeneratorRequest {
	var (
		seen  = map[string]protoreflect.FileDescriptor{}
		order []*descriptorpb.FileDescriptorProto
		visit func(fd protoreflect.FileDescriptor)
	)
	visit = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] != nil {
			return
		}
		seen[fd.Path()] = fd
		imports := fd.Imports()
		for i := range imports.Len() {
			visit(imports.Get(i).FileDescriptor)
		}
		order = append(order, protodesc.ToFileDescriptorProto(fd))
	}
	for _, fd := range compiled {
		visit(fd)
	}
	generate := map[string]bool{}
	for _, f := range toGenerate {
		generate[f] = true
	}
	for _, fdp := range order {
		if generate[fdp.GetName()] {
			asOptionImports(fdp, seen)
		}
	}
	return &pluginpb.CodeGeneratorRequest{
		FileToGenerate: toGenerate,
		Parameter:      proto.String("module=" + goModule),
		ProtoFile:      order,
	}
}

// asOptionImports turns every import of fdp that only its options use (no
// field, extension or method names a type of it) into an option import
// (edition 2024's `import option`, which protocompile v0.14 cannot parse):
// the options keep their values in the descriptor, but protoc-gen-go
// generates no Go import for the file. So the buf.validate rules stay in
// the API's descriptors, where the agent's protovalidate reads them, and a
// client of the API (aether-cni) does not link buf/validate and the
// descriptor.proto types it needs. Public imports stay imports.
func asOptionImports(fdp *descriptorpb.FileDescriptorProto, files map[string]protoreflect.FileDescriptor) {
	if len(fdp.GetPublicDependency()) > 0 || len(fdp.GetWeakDependency()) > 0 {
		return
	}
	used := map[string]bool{}
	for _, name := range typeNames(fdp) {
		used[strings.TrimPrefix(name, ".")] = true
	}
	var deps, optionDeps []string
	for _, dep := range fdp.GetDependency() {
		if fd := files[dep]; fd != nil && !declaresAny(fd, used) {
			optionDeps = append(optionDeps, dep)
			continue
		}
		deps = append(deps, dep)
	}
	fdp.Dependency = deps
	fdp.OptionDependency = append(fdp.OptionDependency, optionDeps...)
}

// typeNames lists the fully qualified type names fdp refers to: field types
// and extendees (also of nested messages and extensions) and method
// input and output types.
func typeNames(fdp *descriptorpb.FileDescriptorProto) []string {
	var names []string
	fields := func(fs []*descriptorpb.FieldDescriptorProto) {
		for _, f := range fs {
			names = append(names, f.GetTypeName(), f.GetExtendee())
		}
	}
	var msgs func([]*descriptorpb.DescriptorProto)
	msgs = func(ms []*descriptorpb.DescriptorProto) {
		for _, m := range ms {
			fields(m.GetField())
			fields(m.GetExtension())
			msgs(m.GetNestedType())
		}
	}
	msgs(fdp.GetMessageType())
	fields(fdp.GetExtension())
	for _, s := range fdp.GetService() {
		for _, m := range s.GetMethod() {
			names = append(names, m.GetInputType(), m.GetOutputType())
		}
	}
	return names
}

// declaresAny reports whether fd declares a message or enum named in names.
func declaresAny(fd protoreflect.FileDescriptor, names map[string]bool) bool {
	var msgs func(protoreflect.MessageDescriptors) bool
	enums := func(es protoreflect.EnumDescriptors) bool {
		for i := range es.Len() {
			if names[string(es.Get(i).FullName())] {
				return true
			}
		}
		return false
	}
	msgs = func(ms protoreflect.MessageDescriptors) bool {
		for i := range ms.Len() {
			m := ms.Get(i)
			if names[string(m.FullName())] || enums(m.Enums()) || msgs(m.Messages()) {
				return true
			}
		}
		return false
	}
	return msgs(fd.Messages()) || enums(fd.Enums())
}

func runPlugin(ctx context.Context, plugin string, req *pluginpb.CodeGeneratorRequest, outRoot string) (int, error) {
	in, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return 0, fmt.Errorf("failed to marshal request for %q: %w", plugin, err)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, plugin)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(in), &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("failed to run plugin %q (build it with 'make tools'): %w: %s", plugin, err, stderr.String())
	}
	var resp pluginpb.CodeGeneratorResponse
	if err := proto.Unmarshal(stdout.Bytes(), &resp); err != nil {
		return 0, fmt.Errorf("failed to decode the response of %q: %w", plugin, err)
	}
	if resp.Error != nil {
		return 0, fmt.Errorf("plugin %q: %s", plugin, resp.GetError())
	}
	for _, f := range resp.File {
		if f.GetInsertionPoint() != "" {
			return 0, errors.New("insertion points are not supported")
		}
		path := filepath.Join(outRoot, filepath.FromSlash(f.GetName()))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return 0, fmt.Errorf("failed to create %q: %w", filepath.Dir(path), err)
		}
		if err := os.WriteFile(path, []byte(f.GetContent()), 0o644); err != nil {
			return 0, fmt.Errorf("failed to write %q: %w", path, err)
		}
	}
	return len(resp.File), nil
}

func byPackage(fds []protoreflect.FileDescriptor) map[string][]protoreflect.FileDescriptor {
	out := map[string][]protoreflect.FileDescriptor{}
	for _, fd := range fds {
		pkg := string(fd.Package())
		out[pkg] = append(out[pkg], fd)
	}
	return out
}
