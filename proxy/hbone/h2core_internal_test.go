package hbone

import (
	"testing"

	"golang.org/x/net/http2"
)

// TestStreamState: each END_STREAM closes one half (RFC 9113 §5.1), in
// either order, and a closed stream stays closed.
func TestStreamState(t *testing.T) {
	for _, tc := range []struct {
		from          streamState
		local, remote streamState
		localClosed   bool
	}{
		{stateIdle, stateIdle, stateIdle, false},
		{stateOpen, stateHalfClosedLocal, stateHalfClosedRemote, false},
		{stateHalfClosedLocal, stateHalfClosedLocal, stateClosed, true},
		{stateHalfClosedRemote, stateClosed, stateHalfClosedRemote, false},
		{stateClosed, stateClosed, stateClosed, true},
	} {
		if got := tc.from.closeLocal(); got != tc.local {
			t.Errorf("%s: after our END_STREAM %s, want %s", tc.from, got, tc.local)
		}
		if got := tc.from.closeRemote(); got != tc.remote {
			t.Errorf("%s: after the peer's END_STREAM %s, want %s", tc.from, got, tc.remote)
		}
		if got := tc.from.localClosed(); got != tc.localClosed {
			t.Errorf("%s: localClosed %v, want %v", tc.from, got, tc.localClosed)
		}
	}
	if s := stateHalfClosedRemote.String(); s != "half-closed (remote)" {
		t.Errorf("String = %q", s)
	}
}

// TestRecvWindow: DATA beyond the window is refused without taking any;
// consumed bytes are granted back a quarter of the window at a time, and
// not at all once the peer ended the stream.
func TestRecvWindow(t *testing.T) {
	const window = 1000
	r := h2Recv{recvWin: window}
	if r.consume(window + 1) {
		t.Fatal("DATA beyond the window taken")
	}
	if !r.consume(600) || r.recvWin != 400 {
		t.Fatalf("after 600 bytes: window %d, want 400", r.recvWin)
	}
	if wu := r.grant(3, 200, window, false); wu != nil {
		t.Fatalf("WINDOW_UPDATE for 200 of a 1000-byte window: %x", wu)
	}
	wu := r.grant(3, 100, window, false)
	if len(wu) != frameHeaderLen+4 || http2.FrameType(wu[3]) != http2.FrameWindowUpdate || r.recvWin != 700 || r.credit != 0 {
		t.Fatalf("after 300 consumed: %x, window %d, credit %d; want a WINDOW_UPDATE of 300, window 700", wu, r.recvWin, r.credit)
	}
	if wu := r.grant(3, 600, window, true); wu != nil {
		t.Fatal("WINDOW_UPDATE after the peer's END_STREAM")
	}
}
