# aether-node. Every tool version is pinned: Go modules and tools in go.mod,
# golangci-lint below. Run as root for `test`, `bench` and `demo`.
SHELL := /bin/bash
GO ?= go
export GOFLAGS ?= -buildvcs=false

CACHE ?= $(HOME)/.cache/aether-node
GOLANGCI_VERSION := v2.15.0
GOLANGCI := $(CACHE)/tools/golangci-lint-$(GOLANGCI_VERSION)/golangci-lint
TOOLS := bin/tools
TEST_TIMEOUT ?= 45m
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
IMAGE ?= localhost/aether-node:$(VERSION)
# Every image entry and the config carry this time, so one commit gives one digest.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
# The architectures of the image's index (make image), all built from this tree in one run.
IMAGE_ARCHS ?= amd64 arm64
BENCH ?= .
BENCHTIME ?= 1s
# BENCHCOUNT rounds of every benchmark (each round runs ours then peer once, so the two
# alternate in time, which go test -count does not: it repeats ours, then peer); the table
# takes each metric's median.
BENCHCOUNT ?= 1
# BENCHPKGS: the packages `make bench` runs; the default, every package, also runs
# test/interop/istio's module (Istio's pkg/hbone), a narrower list does not.
BENCHPKGS ?= ./...

.PHONY: all build build-debug image test test-interop bench bench-readme demo generate lint tools deps clean

# LDFLAGS for `build`: release binaries carry no symbol table or DWARF.
# `make build-debug` (or `make build LDFLAGS=`) keeps them for dlv and pprof.
LDFLAGS ?= -s -w
# TAGS for `build`: grpcnotrace drops gRPC's golang.org/x/net/trace (and the
# html/template it pulls), which nothing enables: smaller binaries, less
# init work in every CNI plugin exec.
TAGS ?= grpcnotrace

# SURROGATE_TAG selects eni-vlan's macvlan surrogate link (test builds only);
# SURROGATE_PKGS are the packages holding tests behind that tag.
SURROGATE_TAG := enivlan_surrogate_link
SURROGATE_PKGS = $(sort $(dir $(shell grep -rl --include='*_test.go' '^//go:build $(SURROGATE_TAG)' enivlan)))

all: build

## build: all release binaries into bin/ (stripped: -s -w)
build:
	CGO_ENABLED=0 $(GO) build -trimpath -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o bin/ ./cmd/...

## build-debug: all binaries into bin/ with symbols and DWARF (for dlv, pprof, panics with file:line)
build-debug:
	$(MAKE) build LDFLAGS=

## image: multi-architecture OCI image (an index over IMAGE_ARCHS) of the release binaries, built
## for each architecture into bin/linux_<arch>/, no Docker daemon: bin/image/oci (layout) and
## bin/image/aether-node.tar
image:
	for arch in $(IMAGE_ARCHS); do \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$arch $(GO) build -trimpath -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o bin/linux_$$arch/ ./cmd/... || exit 1; \
	done
	$(GO) run ./tools/image $(foreach arch,$(IMAGE_ARCHS),-arch-bin $(arch)=bin/linux_$(arch)) \
		-out bin/image -ref $(IMAGE) -version $(VERSION) -created-unix $(SOURCE_DATE_EPOCH)

## tools: protoc-gen-go and protoc-gen-go-grpc at the versions go.mod pins
tools:
	$(GO) build -o $(TOOLS)/ google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc

## generate: Go code and docs/api from api/**/*.proto (no network, no protoc); deploy/aether-node.yaml
## and docs/install.md's values table from the Helm chart (helm is built once per machine, cached)
generate: tools
	$(GO) run ./tools/protogen -proto-root api -docs docs/api \
		-protoc-gen-go $(TOOLS)/protoc-gen-go -protoc-gen-go-grpc $(TOOLS)/protoc-gen-go-grpc
	$(GO) run ./tools/chartgen -manifest deploy/aether-node.yaml -doc docs/install.md

$(GOLANGCI):
	GOBIN=$(dir $(GOLANGCI)) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_VERSION)

## lint: golangci-lint (errorlint, forbidigo, sloglint, gofumpt, ...) and go vet
lint: $(GOLANGCI)
	$(GO) vet ./...
	$(GO) vet -tags aethervm ./test/vm/...
	$(GO) vet -tags $(SURROGATE_TAG) ./enivlan/...
	# Linux-only code lives in _linux.go files: the tree vets on another
	# unix too (a developer's macOS).
	GOOS=darwin $(GO) vet ./...
	$(GOLANGCI) run ./...

## deps: Debian packages the test lanes, benchmarks and demo need (as root)
deps:
	./scripts/install-deps.sh

## test: every test lane (unit, netns, containerd, kube-apiserver, VM, the arm64 binaries under qemu-user); as root
test: deps
	@if [ "$$(id -u)" != 0 ]; then echo "make test needs root (network namespaces, mounts, qemu lane)"; exit 1; fi
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -tags $(SURROGATE_TAG) $(addprefix ./,$(SURROGATE_PKGS))
	$(MAKE) test-interop

## test-interop: proxy/hbone against Istio's Go pkg/hbone, both ways (own module: test/interop/istio;
## cold: ~10-20 s of module downloads + ~1.6 min build on 2 quiet cores (2.5 min CPU), warm: ~5 s)
test-interop:
	cd test/interop/istio && $(GO) test -count=1 -timeout $(TEST_TIMEOUT) ./...

## bench: every comparison benchmark, one table (bench/out/results.json, and the run's date,
## machine and load in bench/out/run.json)
bench: deps
	@mkdir -p bench/out
	@: > bench/out/raw.txt
	for round in $$(seq $(BENCHCOUNT)); do \
		echo "aether-bench round=$$round time=$$(date -u +%FT%TZ) load=$$(cut -d' ' -f1 /proc/loadavg)" | tee -a bench/out/raw.txt; \
		$(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -timeout 60m $(BENCHPKGS) | tee -a bench/out/raw.txt; \
		$(if $(filter ./...,$(BENCHPKGS)),(cd test/interop/istio && $(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -timeout 60m ./...) | tee -a bench/out/raw.txt;) \
	done
	echo "aether-bench end time=$$(date -u +%FT%TZ) load=$$(cut -d' ' -f1 /proc/loadavg)" | tee -a bench/out/raw.txt
	$(GO) run ./tools/benchreport -in bench/out/raw.txt -goals bench/goals -out bench/out \
		-commit '$(VERSION)' -bench '$(BENCH)' -benchtime $(BENCHTIME) -rounds $(BENCHCOUNT) -pkgs '$(BENCHPKGS)'

## bench-readme: the README's performance table (between its benchreport marker lines) from the
## last `make bench` (bench/out/results.json and run.json); not part of `generate`, whose CI check
## has no bench/out
bench-readme:
	$(GO) run ./tools/benchreport -readme README.md -goals bench/goals -out bench/out

## demo: the whole-node demo
demo: deps build
	./scripts/demo.sh

clean:
	rm -rf bin bench/out
