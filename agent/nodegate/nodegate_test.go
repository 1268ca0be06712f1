package nodegate

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

var (
	notReady   = corev1.Taint{Key: TaintKey, Effect: corev1.TaintEffectNoSchedule}
	notReadyNE = corev1.Taint{Key: TaintKey, Effect: corev1.TaintEffectNoExecute}
	other      = corev1.Taint{Key: "example.com/dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}
)

func node(taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", ResourceVersion: "7"}, Spec: corev1.NodeSpec{Taints: taints}}
}

func newRemover(cs *fake.Clientset) *Remover {
	r := New(cs, "n1", nil)
	r.InitialBackoff, r.MaxBackoff = time.Millisecond, 4*time.Millisecond
	return r
}

func taintsOf(t *testing.T, cs *fake.Clientset) []corev1.Taint {
	t.Helper()
	n, err := cs.CoreV1().Nodes().Get(context.Background(), "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.Spec.Taints
}

func patches(cs *fake.Clientset) int {
	n := 0
	for _, a := range cs.Actions() {
		if a.GetVerb() == "patch" {
			n++
		}
	}
	return n
}

func TestRemove(t *testing.T) {
	for _, tc := range []struct {
		name        string
		taints      []corev1.Taint
		want        []corev1.Taint
		wantPatches int
	}{
		{"only the taint", []corev1.Taint{notReady}, nil, 1},
		{"other taints survive", []corev1.Taint{other, notReady, notReadyNE}, []corev1.Taint{other, notReadyNE}, 1},
		{"absent: no patch", []corev1.Taint{other}, []corev1.Taint{other}, 0},
		{"no taints: no patch", nil, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := fake.NewClientset(node(tc.taints...))
			if err := newRemover(cs).Remove(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := taintsOf(t, cs); !slices.Equal(got, tc.want) {
				t.Errorf("taints = %v, want %v", got, tc.want)
			}
			if got := patches(cs); got != tc.wantPatches {
				t.Errorf("patches = %d, want %d", got, tc.wantPatches)
			}
			// A second run is a no-op.
			if err := newRemover(cs).Remove(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := patches(cs); got != tc.wantPatches {
				t.Errorf("patches after a second Remove = %d, want %d", got, tc.wantPatches)
			}
		})
	}
}

// TestRemoveRetriesConflict: a patch that conflicts (the Node changed since
// it was read) is retried after reading the Node again.
func TestRemoveRetriesConflict(t *testing.T) {
	cs := fake.NewClientset(node(other, notReady))
	conflicts := 2
	cs.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if conflicts == 0 {
			return false, nil, nil
		}
		conflicts--
		return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "nodes"}, "n1", errors.New("the object has been modified"))
	})
	if err := newRemover(cs).Remove(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := taintsOf(t, cs); !slices.Equal(got, []corev1.Taint{other}) {
		t.Errorf("taints = %v, want only %v", got, other)
	}
	if got := patches(cs); got != 3 {
		t.Errorf("patches = %d, want 3 (two conflicts, then success)", got)
	}
}

// TestRemoveBoundedByContext: an API that keeps failing is retried until
// ctx ends, and Remove then returns ctx's error.
func TestRemoveBoundedByContext(t *testing.T) {
	cs := fake.NewClientset(node(notReady))
	ctx, cancel := context.WithCancel(context.Background())
	gets := 0
	cs.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if gets++; gets == 3 {
			cancel()
		}
		return true, nil, apierrors.NewServiceUnavailable("apiserver down")
	})
	err := newRemover(cs).Remove(ctx)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Remove = %v, want context.Canceled", err)
	}
	if gets != 3 {
		t.Errorf("gets = %d, want 3", gets)
	}
}

// TestRunAfterWaitsForReady: nothing touches the Node before ready closes;
// a shutdown before then leaves the taint.
func TestRunAfterWaitsForReady(t *testing.T) {
	cs := fake.NewClientset(node(other, notReady))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := newRemover(cs).RunAfter(ctx, make(chan struct{})); err != nil {
		t.Fatalf("RunAfter stopped before ready = %v, want nil", err)
	}
	if n := len(cs.Actions()); n != 0 {
		t.Fatalf("API calls before ready = %v, want none", cs.Actions())
	}
	if got := taintsOf(t, cs); !slices.Equal(got, []corev1.Taint{other, notReady}) {
		t.Fatalf("taints = %v, want unchanged", got)
	}

	ready := make(chan struct{})
	close(ready)
	if err := newRemover(cs).RunAfter(context.Background(), ready); err != nil {
		t.Fatal(err)
	}
	if got := taintsOf(t, cs); !slices.Equal(got, []corev1.Taint{other}) {
		t.Errorf("taints after ready = %v, want only %v", got, other)
	}
}

// TestTaintsPatch pins the wire form: the list without the taint, guarded
// by the resourceVersion; an empty list removes the field.
func TestTaintsPatch(t *testing.T) {
	for _, tc := range []struct {
		keep []corev1.Taint
		want string
	}{
		{nil, `{"metadata":{"resourceVersion":"7"},"spec":{"taints":null}}`},
		{[]corev1.Taint{other}, `{"metadata":{"resourceVersion":"7"},"spec":{"taints":[{"key":"example.com/dedicated","value":"db","effect":"NoSchedule"}]}}`},
	} {
		b, err := taintsPatch("7", tc.keep)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != tc.want {
			t.Errorf("taintsPatch(%v) = %s, want %s", tc.keep, b, tc.want)
		}
	}
}
