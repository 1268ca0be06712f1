package kubernetes_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// segment is one TCP segment seen on a fabric link.
type segment struct {
	src, dst netip.AddrPort
	seq      uint32
	syn      bool
	payload  []byte
}

// fabricCapture reads every frame crossing one link of the fabric (an
// AF_PACKET socket in the fabric netns) and keeps the TCP segments from
// or to a pod address (clusterCIDR); node-to-node traffic (kubelet, the
// apiserver) is not the mesh's.
type fabricCapture struct {
	fd   int
	stop chan struct{}
	done chan struct{}
	mu   sync.Mutex
	segs []segment
}

// startCapture opens the capture on link (in the fabric netns); Stop ends
// it (also in t.Cleanup).
func startCapture(t *testing.T, fabric *harness.NS, link string) *fabricCapture {
	t.Helper()
	proto := int(htons(unix.ETH_P_ALL))
	c := &fabricCapture{stop: make(chan struct{}), done: make(chan struct{})}
	fabric.MustDo(t, func() error {
		ifi, err := net.InterfaceByName(link)
		if err != nil {
			return err
		}
		if c.fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto); err != nil {
			return fmt.Errorf("failed to open an AF_PACKET socket: %w", err)
		}
		if err := unix.Bind(c.fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
			return fmt.Errorf("failed to bind the capture to %s: %w", link, err)
		}
		_ = unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20)
		tv := unix.NsecToTimeval((100 * time.Millisecond).Nanoseconds())
		return unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	})
	_, pods, _ := net.ParseCIDR(clusterCIDR)
	go func() {
		defer close(c.done)
		buf := make([]byte, 1<<16)
		for {
			// Stop ends the loop only once the socket is drained (a receive
			// timed out): the frames of the last connection are kept.
			n, _, err := unix.Recvfrom(c.fd, buf, 0)
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
				select {
				case <-c.stop:
					return
				default:
					continue
				}
			}
			if err != nil {
				return
			}
			if s, ok := parseSegment(buf[:n]); ok && (pods.Contains(s.src.Addr().AsSlice()) || pods.Contains(s.dst.Addr().AsSlice())) {
				c.mu.Lock()
				c.segs = append(c.segs, s)
				c.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { c.Stop() })
	return c
}

// Stop ends the capture (after reading every frame already received) and
// returns the segments seen.
func (c *fabricCapture) Stop() []segment {
	select {
	case <-c.stop:
	default:
		close(c.stop)
		<-c.done
		_ = unix.Close(c.fd)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.segs
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// parseSegment decodes an Ethernet frame carrying IPv4 TCP.
func parseSegment(f []byte) (segment, bool) {
	if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:14]) != unix.ETH_P_IP {
		return segment{}, false
	}
	ip := f[14:]
	ihl := int(ip[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if ip[9] != unix.IPPROTO_TCP || ihl < 20 || total > len(ip) || total < ihl+20 {
		return segment{}, false
	}
	tcp := ip[ihl:total]
	off := int(tcp[12]>>4) * 4
	if off < 20 || off > len(tcp) {
		return segment{}, false
	}
	src, _ := netip.AddrFromSlice(ip[12:16])
	dst, _ := netip.AddrFromSlice(ip[16:20])
	return segment{
		src:     netip.AddrPortFrom(src, binary.BigEndian.Uint16(tcp[0:2])),
		dst:     netip.AddrPortFrom(dst, binary.BigEndian.Uint16(tcp[2:4])),
		seq:     binary.BigEndian.Uint32(tcp[4:8]),
		syn:     tcp[13]&0x02 != 0,
		payload: slices.Clone(tcp[off:]),
	}, true
}

// onlyTLSTo checks that every captured pod segment has port on one side,
// that the bytes of each direction of each connection (reassembled by
// sequence number) are a run of TLS records from the first byte, and that
// none holds plain, the application's bytes. It returns how many
// connections opened during the capture carried data and how many
// segments carried data (a pooled HBONE connection opened earlier carries
// data without a SYN in the capture).
func onlyTLSTo(segs []segment, port uint16, plain []byte) (conns, data int, err error) {
	type dir struct{ src, dst netip.AddrPort }
	streams := map[dir][]segment{}
	for _, s := range segs {
		if s.src.Port() != port && s.dst.Port() != port {
			return 0, 0, fmt.Errorf("a segment %s -> %s (%d bytes) on the fabric is not to or from :%d", s.src, s.dst, len(s.payload), port)
		}
		if len(plain) > 0 && bytes.Contains(s.payload, plain) {
			return 0, 0, fmt.Errorf("a segment %s -> %s carries the application's bytes %q in the clear", s.src, s.dst, plain)
		}
		if len(s.payload) > 0 {
			data++
		}
		streams[dir{s.src, s.dst}] = append(streams[dir{s.src, s.dst}], s)
	}
	opened := map[[2]netip.AddrPort]bool{}
	for d, ss := range streams {
		bytes, fromStart, err := reassemble(ss)
		if err != nil {
			return 0, 0, fmt.Errorf("%s -> %s: %w", d.src, d.dst, err)
		}
		if len(bytes) == 0 || !fromStart {
			continue // opened before the capture: no record boundary known
		}
		if err := tlsRecords(bytes); err != nil {
			return 0, 0, fmt.Errorf("%s -> %s (%d bytes): %w", d.src, d.dst, len(bytes), err)
		}
		k := [2]netip.AddrPort{d.src, d.dst}
		if d.dst.Compare(d.src) < 0 {
			k = [2]netip.AddrPort{d.dst, d.src}
		}
		opened[k] = true
	}
	return len(opened), data, nil
}

// reassemble returns the bytes of one direction in sequence order (from
// the SYN when seen, fromStart, else from the lowest sequence number),
// failing on a gap (a segment the capture missed).
func reassemble(ss []segment) (data []byte, fromStart bool, err error) {
	var base uint32
	haveBase := false
	for _, s := range ss {
		if s.syn {
			base, haveBase = s.seq+1, true
			break
		}
	}
	if !haveBase {
		base = ss[0].seq
		for _, s := range ss {
			if int32(s.seq-base) < 0 {
				base = s.seq
			}
		}
	}
	slices.SortStableFunc(ss, func(a, b segment) int { return int(int32(a.seq - b.seq)) })
	var out []byte
	for _, s := range ss {
		if len(s.payload) == 0 {
			continue
		}
		at := int(int32(s.seq - base))
		switch {
		case at > len(out):
			return nil, false, fmt.Errorf("the capture missed %d bytes at offset %d", at-len(out), len(out))
		case at+len(s.payload) <= len(out):
			continue // a retransmission
		default:
			out = append(out, s.payload[len(out)-at:]...)
		}
	}
	return out, haveBase, nil
}

// tlsRecords checks that data is a run of TLS records (the last one may be
// cut off by the end of the capture).
func tlsRecords(data []byte) error {
	for off := 0; off+5 <= len(data); {
		typ, major, n := data[off], data[off+1], int(binary.BigEndian.Uint16(data[off+3:off+5]))
		if typ < 20 || typ > 23 || major != 3 || n > 1<<14+2048 {
			return fmt.Errorf("not a TLS record at offset %d: % x", off, data[off:min(off+8, len(data))])
		}
		if off == 0 && typ != 22 {
			return fmt.Errorf("the first record is type %d, not a handshake", typ)
		}
		off += 5 + n
	}
	return nil
}
