// Command chartgen writes what `make generate` derives from the Helm chart
// deploy/chart/aether-node: deploy/aether-node.yaml (the chart rendered
// with its default values, see package aether.io/node/deploy/chart) and the
// values table of docs/install.md (from values.yaml's `# --` comments, see
// package valuesdoc).
//
// Usage: go run ./tools/chartgen -manifest deploy/aether-node.yaml -doc docs/install.md
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"aether.io/node/deploy/chart"
	"aether.io/node/tools/chartgen/valuesdoc"
)

func main() {
	manifest := flag.String("manifest", "deploy/aether-node.yaml", "file the default render is written to")
	doc := flag.String("doc", "docs/install.md", "Markdown file whose values table is regenerated")
	flag.Parse()
	if err := run(context.Background(), *manifest, *doc); err != nil {
		fmt.Fprintln(os.Stderr, "chartgen:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, manifest, doc string) error {
	m, err := chart.Manifest(ctx)
	if err != nil {
		return err
	}
	if err := os.WriteFile(manifest, m, 0o644); err != nil {
		return fmt.Errorf("failed to write manifest %q: %w", manifest, err)
	}
	values := filepath.Join(chart.Dir(), "values.yaml")
	src, err := os.ReadFile(values)
	if err != nil {
		return fmt.Errorf("failed to read values %q: %w", values, err)
	}
	vs, err := valuesdoc.Parse(src)
	if err != nil {
		return fmt.Errorf("failed to document values %q: %w", values, err)
	}
	old, err := os.ReadFile(doc)
	if err != nil {
		return fmt.Errorf("failed to read doc %q: %w", doc, err)
	}
	updated, err := valuesdoc.Splice(old, valuesdoc.Table(vs))
	if err != nil {
		return fmt.Errorf("failed to update doc %q: %w", doc, err)
	}
	if err := os.WriteFile(doc, updated, 0o644); err != nil {
		return fmt.Errorf("failed to write doc %q: %w", doc, err)
	}
	return nil
}
