module aether.io/node/test/interop/istio

go 1.26.8

require (
	aether.io/node v0.0.0
	github.com/spiffe/go-spiffe/v2 v2.9.0
	google.golang.org/protobuf v1.36.12
	istio.io/istio v0.0.0-20260827124520-eed52ebb66ad
)

require (
	github.com/cbeuw/connutil v1.0.1 // indirect
	github.com/go-jose/go-jose/v4 v4.1.5 // indirect
	github.com/go-logr/logr v1.4.4 // indirect
	github.com/golang/protobuf v1.5.4 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/planetscale/vtprotobuf v0.6.1-0.20240409071808-615f978279ca // indirect
	github.com/spf13/cobra v1.10.2 // indirect
	github.com/spf13/pflag v1.0.10 // indirect
	go.uber.org/multierr v1.11.0 // indirect
	go.uber.org/zap v1.28.0 // indirect
	golang.org/x/net v0.61.0 // indirect
	golang.org/x/text v0.43.0 // indirect
	google.golang.org/genproto/googleapis/api v0.0.0-20260928230214-8a89bd6388cc // indirect
	google.golang.org/grpc v1.85.0 // indirect
	gopkg.in/natefinch/lumberjack.v2 v2.2.1 // indirect
	istio.io/api v1.32.0 // indirect
	k8s.io/klog/v2 v2.140.0 // indirect
)

replace aether.io/node => ../../..
