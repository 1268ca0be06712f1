// Command protogen generates the Go code and the API reference for every
// .proto file under the proto root, with no protoc and no network.
//
// Imports that are not in the tree (buf/validate, envoy, the well-known types)
// are resolved from the descriptors that their Go packages register in
// protoregistry.GlobalFiles, so the only inputs are this module's go.mod and
// the .proto files. The Go code comes from the protoc-gen-go and
// protoc-gen-go-grpc binaries at the versions pinned in go.mod, fed a
// CodeGeneratorRequest exactly as protoc would; the Markdown reference under
// docs/api is rendered from the same compiled descriptors, so the two cannot
// drift.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"aether.io/node/tools/protogen/gen"
)

func main() {
	var cfg gen.Config
	flag.StringVar(&cfg.ProtoRoot, "proto-root", "api", "directory holding the .proto files (also the import root and the output root for Go code)")
	flag.StringVar(&cfg.GoModule, "go-module", "aether.io/node/api", "Go import path of the proto root (every go_package is under it)")
	flag.StringVar(&cfg.DocsDir, "docs", "docs/api", "directory for the rendered Markdown reference")
	flag.StringVar(&cfg.GoPlugin, "protoc-gen-go", "bin/tools/protoc-gen-go", "path of the protoc-gen-go binary")
	flag.StringVar(&cfg.GRPCPlugin, "protoc-gen-go-grpc", "bin/tools/protoc-gen-go-grpc", "path of the protoc-gen-go-grpc binary")
	flag.Parse()

	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := gen.Run(context.Background(), cfg, log); err != nil {
		fmt.Fprintln(os.Stderr, "protogen:", err)
		os.Exit(1)
	}
}
