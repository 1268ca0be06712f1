package flowapi_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"aether.io/node/pkg/flowapi"
)

func TestRequestValidate(t *testing.T) {
	for _, tc := range []struct {
		req     flowapi.Request
		wantErr string
	}{
		{req: flowapi.Request{}},
		{req: flowapi.Request{Pod: "shop/web-1", Namespace: "shop", Denied: true, Service: "db.b.svc.cluster.local", Reporter: "source"}},
		{req: flowapi.Request{Service: "b/db", Reporter: "destination"}},
		{req: flowapi.Request{Pod: "web-1"}, wantErr: `invalid pod "web-1": want <namespace>/<name>`},
		{req: flowapi.Request{Pod: "shop/web/1"}, wantErr: `invalid pod "shop/web/1"`},
		{req: flowapi.Request{Pod: "/web"}, wantErr: `invalid pod "/web"`},
		{req: flowapi.Request{Service: "b/"}, wantErr: `invalid service "b/": want a hostname or <namespace>/<name>`},
		{req: flowapi.Request{Reporter: "client"}, wantErr: `invalid reporter "client": want source or destination`},
	} {
		err := tc.req.Validate()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%+v: %v", tc.req, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%+v: %v, want %q", tc.req, err, tc.wantErr)
		}
	}
}

// TestMessageJSON: an event line is one flat object, the type first and
// then the event's fields; a drop notice carries no event field.
func TestMessageJSON(t *testing.T) {
	ev := &flowapi.Event{Reporter: "source", SrcPod: "web-1", BytesToDst: 5, Reason: "denied", Error: "refused"}
	b, err := json.Marshal(flowapi.Message{Type: flowapi.TypeClosed, Event: ev})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(b), `{"type":"closed","reporter":"source","start_time":"",`) || !strings.HasSuffix(string(b), `"error":"refused"}`) {
		t.Errorf("event line %s", b)
	}
	var back flowapi.Message
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if back.Event == nil || *back.Event != *ev {
		t.Errorf("decoded %+v, want %+v", back.Event, ev)
	}
	b, err = json.Marshal(flowapi.Message{Type: flowapi.TypeDropped, Dropped: 12})
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"type":"dropped","dropped":12}` {
		t.Errorf("drop notice %s", b)
	}
}

// serve answers one connection on a unix socket: it reads the request line
// into got, then writes lines and closes.
func serve(t *testing.T, lines ...string) (string, <-chan flowapi.Request) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "flows.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	got := make(chan flowapi.Request, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		line, err := bufio.NewReader(c).ReadBytes('\n')
		if err != nil {
			return
		}
		var req flowapi.Request
		if json.Unmarshal(line, &req) == nil {
			got <- req
		}
		for _, l := range lines {
			if _, err := io.WriteString(c, l+"\n"); err != nil {
				return
			}
		}
	}()
	return sock, got
}

func TestSubscribe(t *testing.T) {
	ctx := context.Background()
	t.Run("events after the answer, EOF at the end", func(t *testing.T) {
		sock, got := serve(t, `{"type":"subscribed","queue":4096}`, `{"type":"opened","reporter":"source","src_pod":"web-1"}`, `{"type":"dropped","dropped":3}`)
		want := flowapi.Request{Pod: "shop/web-1", Denied: true}
		s, err := flowapi.Subscribe(ctx, sock, want)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if r := <-got; r != want {
			t.Errorf("server read %+v, want %+v", r, want)
		}
		if s.Queue != 4096 {
			t.Errorf("queue %d, want 4096", s.Queue)
		}
		m, err := s.Next()
		if err != nil || m.Type != flowapi.TypeOpened || m.Event == nil || m.SrcPod != "web-1" {
			t.Errorf("first message %+v, %v", m, err)
		}
		m, err = s.Next()
		if err != nil || m.Type != flowapi.TypeDropped || m.Dropped != 3 || m.Event != nil {
			t.Errorf("second message %+v, %v", m, err)
		}
		if _, err := s.Next(); !errors.Is(err, io.EOF) {
			t.Errorf("after the last message: %v, want EOF", err)
		}
	})
	t.Run("refused", func(t *testing.T) {
		sock, _ := serve(t, `{"type":"error","detail":"permission denied: peer uid 1000 is not allowed"}`)
		_, err := flowapi.Subscribe(ctx, sock, flowapi.Request{})
		var re *flowapi.RefusedError
		if !errors.As(err, &re) || re.Detail != "permission denied: peer uid 1000 is not allowed" {
			t.Fatalf("Subscribe = %v, want the server's refusal", err)
		}
		if err.Error() != "aether-proxy refused the subscription: permission denied: peer uid 1000 is not allowed" {
			t.Errorf("error text %q", err)
		}
	})
	t.Run("no socket", func(t *testing.T) {
		missing := filepath.Join(t.TempDir(), "flows.sock")
		_, err := flowapi.Subscribe(ctx, missing, flowapi.Request{})
		if !errors.Is(err, flowapi.ErrNoSocket) || !strings.Contains(err.Error(), "-flows-socket") || !strings.Contains(err.Error(), missing) {
			t.Errorf("Subscribe(missing) = %v, want ErrNoSocket naming the path and -flows-socket", err)
		}
	})
	t.Run("stale socket", func(t *testing.T) {
		stale := filepath.Join(t.TempDir(), "flows.sock")
		ln, err := net.Listen("unix", stale)
		if err != nil {
			t.Fatal(err)
		}
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		_ = ln.Close()
		if _, err := os.Stat(stale); err != nil {
			t.Fatal(err)
		}
		if _, err := flowapi.Subscribe(ctx, stale, flowapi.Request{}); !errors.Is(err, flowapi.ErrNoSocket) {
			t.Errorf("Subscribe(stale) = %v, want ErrNoSocket", err)
		}
	})
	t.Run("invalid request", func(t *testing.T) {
		if _, err := flowapi.Subscribe(ctx, "/nonexistent", flowapi.Request{Pod: "nope"}); err == nil || !strings.Contains(err.Error(), `invalid pod "nope"`) {
			t.Errorf("Subscribe(invalid) = %v", err)
		}
	})
}
