package flowserver

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/pkg/peercred"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/proxy/telemetry"
)

// RequestTimeout bounds how long a client may take to send its request
// line after it connected.
const RequestTimeout = 10 * time.Second

// writeBuffer is each client's write buffer: events are flushed when its
// queue is empty, or when this much is held.
const writeBuffer = 64 << 10

// Options configure New.
type Options struct {
	// AllowedUIDs are the peer uids that may subscribe; empty means uid 0
	// only. Any other peer, or one whose credentials cannot be read, is
	// answered a flowapi.TypeError and closed (counted:
	// aether_proxy_flow_peers_rejected_total).
	AllowedUIDs []uint32
	// Logger logs subscribers and refused peers; nil discards.
	Logger *slog.Logger
}

// Server serves the flows socket protocol from a hub. Build it with New;
// Serve it on Listen's listener; Close stops it.
type Server struct {
	flows *telemetry.Flows
	uids  []uint32
	log   *slog.Logger

	mu     sync.Mutex
	closed bool
	ln     net.Listener
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
	done   chan struct{}
}

// New returns a server of flows' events; it does no I/O.
func New(flows *telemetry.Flows, o Options) *Server {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	uids := o.AllowedUIDs
	if len(uids) == 0 {
		uids = []uint32{0}
	}
	return &Server{flows: flows, uids: slices.Clone(uids), log: log, conns: map[net.Conn]struct{}{}, done: make(chan struct{})}
}

// Listen opens the flows socket at path with the socket policy of
// pkg/unixsock (mode 0600; a stale socket replaced, a live one refused; a
// missing directory created 0700). The directory may be readable by group
// and others, as kubelet creates a hostPath directory (0755), never
// writable by them.
func Listen(path string) (*net.UnixListener, error) {
	return unixsock.Listen(path, unixsock.AllowReadableDir())
}

// Serve accepts clients on ln until Close, through transient accept
// errors (EMFILE...) with a backoff; it returns nil after Close.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = ln.Close()
		return nil
	}
	s.ln = ln
	s.mu.Unlock()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			select {
			case <-s.done:
				return nil
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("flows listener closed: %w", err)
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("flows accept failed", "error", err.Error())
			select {
			case <-time.After(backoff):
			case <-s.done:
				return nil
			}
			continue
		}
		backoff = 0
		if !s.track(c) {
			_ = c.Close()
			return nil
		}
		go s.serveConn(c)
	}
}

// Close stops accepting, closes every client's connection at once (what
// their queues hold is not sent) and waits for their goroutines.
func (s *Server) Close() {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.done)
		if s.ln != nil {
			_ = s.ln.Close()
		}
		for c := range s.conns {
			_ = c.Close()
		}
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// track registers a client's connection; false once the server is closed.
func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	return true
}

func (s *Server) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	_ = c.Close()
	s.wg.Done()
}

// serveConn checks the peer, reads its request, and streams its events
// until it goes away or the server closes.
func (s *Server) serveConn(c net.Conn) {
	defer s.untrack(c)
	cred, err := peercred.Read(c)
	if err != nil || !slices.Contains(s.uids, cred.UID) {
		s.flows.PeerRejected()
		s.log.Warn("flows peer rejected", "peer_uid", int64(cred.UID), "peer_known", err == nil)
		detail := fmt.Sprintf("permission denied: peer uid %d may not follow flows (allowed uids: %v)", cred.UID, s.uids)
		if err != nil {
			detail = "permission denied: " + err.Error()
		}
		refuse(c, detail)
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(RequestTimeout))
	in := bufio.NewReaderSize(c, flowapi.MaxRequestBytes)
	req, err := readRequest(in)
	if err != nil {
		refuse(c, err.Error())
		return
	}
	sub, err := s.flows.Subscribe(req)
	if err != nil {
		refuse(c, err.Error())
		return
	}
	defer sub.Close()
	_ = c.SetReadDeadline(time.Time{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The client sends nothing after its request: its EOF (or anything
	// else) ends the subscription. The read ends when c closes at the
	// latest (untrack).
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		_, _ = io.Copy(io.Discard, in)
		cancel()
	}()
	log := s.log.With("peer_uid", int64(cred.UID), "peer_pid", int64(cred.PID))
	log.Info("flows subscriber joined", "pod", req.Pod, "namespace", req.Namespace, "denied", req.Denied, "service", req.Service, "reporter", req.Reporter)
	err = stream(ctx, c, sub)
	_ = c.Close()
	<-gone
	log.Info("flows subscriber left", "error", errText(err))
}

// stream writes the subscription's answer and then its messages to w,
// flushed whenever the queue is empty, until ctx ends or a write fails.
func stream(ctx context.Context, w io.Writer, sub *telemetry.Subscription) error {
	bw := bufio.NewWriterSize(w, writeBuffer)
	enc := json.NewEncoder(bw)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(flowapi.Message{Type: flowapi.TypeSubscribed, Queue: telemetry.FlowQueue}); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	for {
		m, err := sub.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil // the client went away
			}
			return err
		}
		if err := enc.Encode(m); err != nil {
			return err
		}
		if !sub.Pending() {
			if err := bw.Flush(); err != nil {
				return err
			}
		}
	}
}

// readRequest reads and checks the request line.
func readRequest(in *bufio.Reader) (flowapi.Request, error) {
	var req flowapi.Request
	line, err := in.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		return req, fmt.Errorf("invalid request: longer than %d bytes", flowapi.MaxRequestBytes)
	}
	if err != nil {
		return req, fmt.Errorf("failed to read the request line: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields() // a filter this proxy does not know is refused, never ignored
	if err := dec.Decode(&req); err != nil {
		return req, fmt.Errorf("invalid request %q: %w", bytes.TrimSpace(line), err)
	}
	return req, req.Validate()
}

// refuse answers a flowapi.TypeError; the caller closes.
func refuse(c net.Conn, detail string) {
	_ = c.SetWriteDeadline(time.Now().Add(RequestTimeout))
	line, _ := json.Marshal(flowapi.Message{Type: flowapi.TypeError, Detail: detail})
	_, _ = c.Write(append(line, '\n'))
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
