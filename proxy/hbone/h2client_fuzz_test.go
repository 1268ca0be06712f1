package hbone

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"testing"

	"golang.org/x/net/http2"
)

// FuzzClientConn feeds arbitrary bytes from the server to the Dialer's
// HTTP/2 client engine, after valid SETTINGS and with two CONNECT streams
// (1 and 3) waiting for their answers: malformed frames, bad HPACK, frames
// in the wrong stream state, flow-control violations. The engine must
// send only frames a conforming HTTP/2 parser accepts, end the connection
// when the server's input ends, fail or end every stream, and leave no
// goroutine behind; a panic fails, a hang never returns.
func FuzzClientConn(f *testing.F) {
	ok := func(id uint32, end bool) *frames { return newFrames().headers(id, end, ":status", "200") }
	seeds := []*frames{
		ok(1, false).data(1, false, "hello").data(1, true, "bye").headers(3, true, ":status", "502"),
		ok(1, false).data(1, false, "x").headers(1, true, "trailer", "v"),
		ok(1, false).headers(1, false, "trailer", "v"),
		ok(3, false).data(3, true, "three").data(3, false, "after end"),
		newFrames().headers(1, false, ":status", "100").headers(1, true, ":status", "200"),
		newFrames().headers(1, true, ":status", "abc").headers(3, true),
		newFrames().headers(5, false, ":status", "200"),
		newFrames().headers(2, false, ":status", "200"),
		newFrames().data(1, false, "before the answer"),
		newFrames().data(7, false, "idle stream"),
		ok(1, false).data(1, false, string(make([]byte, 1<<16+1))),
		newFrames().settings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1}).settings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 20}),
		newFrames().settings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1}),
		newFrames().settings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 0}),
	}
	{
		s := ok(1, false)
		_ = s.fr.WriteRSTStream(1, http2.ErrCodeNo)
		_ = s.fr.WriteRSTStream(3, http2.ErrCodeRefusedStream)
		_ = s.fr.WriteWindowUpdate(1, 10)
		s.data(1, false, "after reset")
		seeds = append(seeds, s)
		s = ok(1, true)
		_ = s.fr.WriteRSTStream(1, http2.ErrCodeNo)
		_ = s.fr.WriteGoAway(1, http2.ErrCodeNo, nil)
		seeds = append(seeds, s)
		s = ok(3, false)
		_ = s.fr.WriteGoAway(1, http2.ErrCodeEnhanceYourCalm, []byte("debug"))
		s.data(3, true, "three")
		seeds = append(seeds, s)
		s = newFrames()
		_ = s.fr.WritePing(false, [8]byte{1})
		_ = s.fr.WritePing(true, [8]byte{2})
		_ = s.fr.WriteWindowUpdate(0, 1<<31-1)
		_ = s.fr.WriteWindowUpdate(0, 1<<31-1)
		seeds = append(seeds, s)
		s = ok(1, false)
		_ = s.fr.WriteWindowUpdate(1, 1<<31-1)
		_ = s.fr.WriteDataPadded(1, false, []byte("padded"), make([]byte, 20))
		_ = s.fr.WritePriority(1, http2.PriorityParam{StreamDep: 3})
		_ = s.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, EndHeaders: true})
		seeds = append(seeds, s)
		s = newFrames()
		_ = s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x88}})
		_ = s.fr.WriteContinuation(3, true, []byte{0x88})
		seeds = append(seeds, s)
		s = newFrames()
		_ = s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0xff, 0xff, 0xff, 0x7f}, EndHeaders: true})
		seeds = append(seeds, s)
		s = newFrames()
		_ = s.fr.WriteData(0, false, []byte("stream 0"))
		seeds = append(seeds, s)
	}
	for _, s := range seeds {
		f.Add(s.Bytes())
	}

	cfg := testDialerConfig()
	cfg.StreamWindow, cfg.ConnWindow = 1<<16, 1<<17
	f.Fuzz(func(t *testing.T, in []byte) {
		c, fs, wg := newClientPair(t, cfg)
		if err := fs.start(c, wg); err != nil {
			t.Fatal(err)
		}
		// Everything the client sends must parse as HTTP/2 frames.
		fs.fr.SetMaxReadFrameSize(1<<24 - 1)
		parsed := make(chan error, 1)
		go func() {
			for {
				if _, err := fs.fr.ReadFrame(); err != nil {
					var ne *net.OpError
					if errors.Is(err, io.EOF) || errors.As(err, &ne) {
						err = nil // the end, or a reset
					}
					parsed <- err
					return
				}
			}
		}()
		// Two streams wait for their answers; an answered one sends,
		// half-closes and reads to its end.
		var streams sync.WaitGroup
		for range 2 {
			if !c.reserve() {
				t.Fatal("no stream slot")
			}
			streams.Add(1)
			go func() {
				defer streams.Done()
				st, err := c.openStream(context.Background(), netip.MustParseAddrPort("127.0.0.1:80"))
				if err != nil {
					return
				}
				defer st.Close()
				if _, err := st.Write([]byte("ping")); err == nil {
					_ = st.CloseWrite()
				}
				_, _ = io.Copy(io.Discard, st)
			}()
		}
		for {
			c.mu.Lock()
			sent := c.nextID == 5
			c.mu.Unlock()
			if sent {
				break
			}
			runtime.Gosched()
		}
		_, _ = fs.conn.Write(in)
		_ = fs.conn.CloseWrite()
		streams.Wait()
		wg.Wait()
		if !c.broken() {
			t.Fatal("connection open after the server's input ended")
		}
		if err := <-parsed; err != nil {
			t.Fatalf("client sent a frame that does not parse: %v", err)
		}
	})
}
