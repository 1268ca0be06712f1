package kube

import (
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
)

type (
	runtimeObject  = runtime.Object
	watchInterface = watch.Interface
)
