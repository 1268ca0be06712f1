package lifecycle

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder appends "start:<name>" and "stop:<name>" as hooks run.
type recorder struct{ events []string }

func (r *recorder) hook(name string, startErr error) Hook {
	return Hook{
		Name: name,
		Start: func(context.Context) error {
			r.events = append(r.events, "start:"+name)
			return startErr
		},
		Stop: func(context.Context) error {
			r.events = append(r.events, "stop:"+name)
			return nil
		},
	}
}

func TestOrder(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		failAt  string
		want    []string
		wantErr string
	}{
		{
			name: "clean run stops in reverse order",
			want: []string{"start:a", "start:b", "start:c", "stop:c", "stop:b", "stop:a"},
		},
		{
			name: "failed start stops what started", failAt: "c",
			want:    []string{"start:a", "start:b", "start:c", "stop:b", "stop:a"},
			wantErr: "failed to start c: boom",
		},
		{
			name: "first start fails, nothing to stop", failAt: "a",
			want:    []string{"start:a"},
			wantErr: "failed to start a: boom",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{}
			l := New(nil, 0)
			for _, n := range []string{"a", "b", "c"} {
				var err error
				if n == tc.failAt {
					err = boom
				}
				l.Append(r.hook(n, err))
			}
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // Run returns as soon as everything started
			err := l.Run(ctx)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("Run = %v, want %q", err, tc.wantErr)
			}
			if tc.wantErr != "" && !errors.Is(err, boom) {
				t.Errorf("Run = %v does not wrap the start error", err)
			}
			if !slices.Equal(r.events, tc.want) {
				t.Fatalf("events %v, want %v", r.events, tc.want)
			}
		})
	}
}

func TestGoJoinsAndFails(t *testing.T) {
	l := New(nil, 0)
	exited := false
	l.Go("clean", func(ctx context.Context) error {
		<-ctx.Done()
		exited = true
		return ctx.Err()
	})
	l.Go("broken", func(context.Context) error { return errors.New("lost the registry") })
	err := l.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "broken stopped: lost the registry") {
		t.Fatalf("Run = %v, want the loop's failure", err)
	}
	if !exited {
		t.Fatal("Run returned before the loop was joined")
	}
}

func TestServe(t *testing.T) {
	l := New(nil, 0)
	var addr net.Addr
	l.Serve("http", func() (net.Listener, Server, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, Server{}, err
		}
		addr = ln.Addr()
		return ln, HTTP(&http.Server{Handler: http.NotFoundHandler()}), nil
	})
	// A second server on the same port fails to start; the first is
	// stopped and its port released.
	l.Serve("clash", func() (net.Listener, Server, error) {
		ln, err := net.Listen("tcp", addr.String())
		return ln, HTTP(&http.Server{Handler: http.NotFoundHandler()}), err
	})
	err := l.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "failed to start clash") {
		t.Fatalf("Run = %v, want the clash", err)
	}
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatalf("port of the stopped server still held: %v", err)
	}
	_ = ln.Close()
}
