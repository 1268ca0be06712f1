// Package lifecycle runs a daemon's parts in a defined order, after Cilium's
// hive: constructors do no I/O; Start runs start hooks in the order they were
// appended; Stop runs stop hooks in reverse order; a failed start stops what
// already started; every background loop owns a context and is joined by its
// stop hook, so nothing outlives Run.
package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// Hook is one part of a daemon. Either function may be nil.
type Hook struct {
	// Name names the part in logs and errors (snake_case).
	Name string
	// Start acquires the part's resources (sockets, files, locks) and
	// starts its goroutines; it must not block on them. An error stops
	// every part started before it.
	Start func(ctx context.Context) error
	// Stop releases what Start acquired and returns only after the part's
	// goroutines have returned. ctx bounds a graceful drain; when it ends
	// the part must stop at once.
	Stop func(ctx context.Context) error
}

// Lifecycle is an ordered list of hooks. Build it with New, Append the
// parts, then Run it. It is not reusable.
type Lifecycle struct {
	log         *slog.Logger
	stopTimeout time.Duration
	hooks       []Hook
	started     int
	failed      chan error
}

// New returns an empty Lifecycle. stopTimeout bounds each stop hook's
// graceful drain (0 means no bound).
func New(log *slog.Logger, stopTimeout time.Duration) *Lifecycle {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Lifecycle{log: log, stopTimeout: stopTimeout, failed: make(chan error, 1)}
}

// Append adds h after the hooks already appended: it starts after them and
// stops before them.
func (l *Lifecycle) Append(h Hook) { l.hooks = append(l.hooks, h) }

// Fail asks Run to stop everything and return err. Only the first failure
// is kept; later ones are logged.
func (l *Lifecycle) Fail(err error) {
	select {
	case l.failed <- err:
	default:
		l.log.Error("part failed during shutdown", "error", err.Error())
	}
}

// Start runs the start hooks in order. When one fails, the hooks already
// started are stopped in reverse order and the error is returned (joined
// with any stop errors).
func (l *Lifecycle) Start(ctx context.Context) error {
	for _, h := range l.hooks[l.started:] {
		if h.Start != nil {
			if err := h.Start(ctx); err != nil {
				err = fmt.Errorf("failed to start %s: %w", h.Name, err)
				return errors.Join(err, l.Stop())
			}
		}
		l.started++
		l.log.Debug("started", "part", h.Name)
	}
	return nil
}

// Stop runs the stop hooks of the started parts in reverse order. Every
// hook runs even when an earlier one fails; the errors are joined.
func (l *Lifecycle) Stop() error {
	var errs []error
	for ; l.started > 0; l.started-- {
		h := l.hooks[l.started-1]
		if h.Stop == nil {
			continue
		}
		ctx, cancel := context.Background(), context.CancelFunc(func() {})
		if l.stopTimeout > 0 {
			ctx, cancel = context.WithTimeout(ctx, l.stopTimeout)
		}
		if err := h.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("failed to stop %s: %w", h.Name, err))
		}
		cancel()
		l.log.Debug("stopped", "part", h.Name)
	}
	return errors.Join(errs...)
}

// Run starts every part, waits until ctx ends or a part fails, then stops
// every part in reverse order. It returns the start error, or the failure,
// joined with stop errors; nil after a clean stop.
func (l *Lifecycle) Run(ctx context.Context) error {
	if err := l.Start(ctx); err != nil {
		return err
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-l.failed:
	}
	return errors.Join(err, l.Stop())
}

// Go appends a background loop: at start, run is called on its own
// goroutine with a context that ends at stop; the stop hook cancels that
// context and waits for run to return. An error run returns before its stop
// fails the lifecycle.
func (l *Lifecycle) Go(name string, run func(ctx context.Context) error) {
	var (
		cancel context.CancelFunc
		done   chan struct{}
	)
	l.Append(Hook{
		Name: name,
		Start: func(context.Context) error {
			var ctx context.Context
			ctx, cancel = context.WithCancel(context.Background())
			done = make(chan struct{})
			go func() {
				defer close(done)
				if err := run(ctx); err != nil && ctx.Err() == nil {
					l.Fail(fmt.Errorf("%s stopped: %w", name, err))
				}
			}()
			return nil
		},
		Stop: func(context.Context) error {
			cancel()
			<-done
			return nil
		},
	})
}

// Server is a server that serves a listener until it is shut down:
// *grpc.Server through GRPC, *http.Server through HTTP.
type Server struct {
	// Serve serves ln until Shutdown; it returns nil (or
	// http.ErrServerClosed) after Shutdown.
	Serve func(ln net.Listener) error
	// Shutdown stops serving, gracefully until ctx ends, then at once.
	Shutdown func(ctx context.Context)
}

// GRPC adapts a grpc.Server (anything with Serve, GracefulStop and Stop).
func GRPC(g interface {
	Serve(net.Listener) error
	GracefulStop()
	Stop()
},
) Server {
	return Server{Serve: g.Serve, Shutdown: func(ctx context.Context) {
		done := make(chan struct{})
		go func() { g.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			g.Stop()
			<-done
		}
	}}
}

// HTTP adapts an http.Server.
func HTTP(s *http.Server) Server {
	return Server{Serve: s.Serve, Shutdown: func(ctx context.Context) {
		if err := s.Shutdown(ctx); err != nil {
			_ = s.Close()
		}
	}}
}

// Serve appends a server: at start, listen opens its listener and builds
// the server (an error fails the start), which then serves on its own
// goroutine; the stop hook shuts it down and waits for Serve to return.
// Serve failing before its stop fails the lifecycle.
func (l *Lifecycle) Serve(name string, listen func() (net.Listener, Server, error)) {
	var (
		mu       sync.Mutex
		stopping bool
		srv      Server
		done     chan struct{}
	)
	l.Append(Hook{
		Name: name,
		Start: func(context.Context) error {
			ln, s, err := listen()
			if err != nil {
				return err
			}
			srv, done = s, make(chan struct{})
			go func() {
				defer close(done)
				err := srv.Serve(ln)
				mu.Lock()
				stopped := stopping
				mu.Unlock()
				if !stopped && !errors.Is(err, http.ErrServerClosed) {
					if err == nil {
						err = errors.New("server returned")
					}
					l.Fail(fmt.Errorf("%s stopped serving: %w", name, err))
				}
			}()
			return nil
		},
		Stop: func(ctx context.Context) error {
			mu.Lock()
			stopping = true
			mu.Unlock()
			srv.Shutdown(ctx)
			<-done
			return nil
		},
	})
}
