package grpcwire

import (
	"testing"
	"time"
)

// The calls themselves are tested against grpc-go servers: the agent's
// CNIService in meshcni/agentclient, the CRI RuntimeService in
// meshcni/podpid, the real agent in meshcni/e2e.

func TestTimeout(t *testing.T) {
	for _, tc := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "1n"},
		{0, "1n"},
		{time.Microsecond, "1m"},
		{2 * time.Second, "2000m"},
		{1999*time.Millisecond + time.Microsecond, "2000m"},
		{99999999 * time.Millisecond, "99999999m"},
		{100000000 * time.Millisecond, "100000S"},
	} {
		if got := timeout(tc.d); got != tc.want {
			t.Errorf("timeout(%v) = %q, want %q", tc.d, got, tc.want)
		}
	}
}

func TestTrailerStatus(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fields map[string]string
		want   Status
		err    bool
	}{
		{"ok", map[string]string{"grpc-status": "0"}, Status{Code: OK}, false},
		{"percent-encoded message", map[string]string{"grpc-status": "5", "grpc-message": "no record %E2%9C%93 100%25"}, Status{Code: NotFound, Message: "no record ✓ 100%"}, false},
		{"undecodable message kept", map[string]string{"grpc-status": "14", "grpc-message": "50%"}, Status{Code: Unavailable, Message: "50%"}, false},
		{"missing status", map[string]string{"grpc-message": "x"}, Status{}, true},
		{"bad status", map[string]string{"grpc-status": "x"}, Status{}, true},
	} {
		st, err := trailerStatus(tc.fields)
		if (err != nil) != tc.err || (err == nil && *st != tc.want) {
			t.Errorf("%s: trailerStatus = %v, %v; want %v (error: %v)", tc.name, st, err, tc.want, tc.err)
		}
	}
}

func TestMessage(t *testing.T) {
	for _, tc := range []struct {
		name string
		data []byte
		want string
		err  bool
	}{
		{"one message", []byte{0, 0, 0, 0, 2, 'h', 'i'}, "hi", false},
		{"empty message", []byte{0, 0, 0, 0, 0}, "", false},
		{"no message", nil, "", true},
		{"compressed", []byte{1, 0, 0, 0, 1, 'x'}, "", true},
		{"short", []byte{0, 0, 0, 0, 3, 'x'}, "", true},
		{"trailing bytes", []byte{0, 0, 0, 0, 1, 'x', 'y'}, "", true},
	} {
		got, err := message(tc.data)
		if (err != nil) != tc.err || string(got) != tc.want {
			t.Errorf("%s: message = %q, %v", tc.name, got, err)
		}
	}
}

func TestCodeOf(t *testing.T) {
	if CodeOf(nil) != OK || CodeOf(&Status{Code: NotFound}) != NotFound || CodeOf(errTest{}) != Unknown {
		t.Fatal("CodeOf")
	}
	if got := (&Status{Code: Unavailable, Message: "x"}).Error(); got != "rpc error: code = Unavailable desc = x" {
		t.Fatalf("Error() = %q", got)
	}
}

type errTest struct{}

func (errTest) Error() string { return "test" }
