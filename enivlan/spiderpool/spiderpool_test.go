package spiderpool_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/enivlan/spiderpool"
)

var (
	ip4 = netip.MustParseAddr("10.77.0.5")
	ip6 = netip.MustParseAddr("fd77::5")
)

func binding() enivlantest.Binding {
	return enivlantest.Binding{
		Namespace: "ns", Name: "pod", UID: "uid-1", VLAN: 100, MAC: "02:aa:00:00:00:05",
		IPv4: "10.77.0.5/24", IPv4Gateway: "10.77.0.1", IPv6: "fd77::5/64", IPv6Gateway: "fd77::1",
	}
}

func query() spiderpool.Query {
	return spiderpool.Query{PodNamespace: "ns", PodName: "pod", PodUID: "uid-1", IfName: "eth0", IPv4: ip4, IPv6: ip6}
}

func body(t testing.TB, b enivlantest.Binding) []byte {
	if b.IfName == "" {
		b.IfName = "eth0"
	}
	out, err := json.Marshal(enivlantest.Render(&b))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestSelect(t *testing.T) {
	tests := []struct {
		name     string
		mod      func(b *enivlantest.Binding, q *spiderpool.Query)
		wantErr  error
		contains string
	}{
		{name: "valid"},
		{name: "missing vlan", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.Answer = enivlantest.MissingVLAN }, wantErr: spiderpool.ErrIncomplete, contains: `no "vlan"`},
		{name: "missing mac", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.Answer = enivlantest.MissingMAC }, wantErr: spiderpool.ErrIncomplete, contains: `no "mac"`},
		{name: "vlan too big", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.VLAN = 4095 }, wantErr: spiderpool.ErrInvalid, contains: "want 1..4094"},
		{name: "vlan negative", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.VLAN = -3 }, wantErr: spiderpool.ErrInvalid, contains: "want 1..4094"},
		{name: "bad mac", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.MAC = "02:aa:00:00:00" }, wantErr: spiderpool.ErrInvalid, contains: "six colon-separated"},
		{name: "multicast mac", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.MAC = "01:00:5e:00:00:01" }, wantErr: spiderpool.ErrInvalid, contains: "unicast"},
		{name: "ipv4 mismatch", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.IPv4 = "10.77.0.9/24" }, wantErr: spiderpool.ErrIncomplete, contains: "IPAM allocated 10.77.0.5"},
		{name: "ipv6 mismatch", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.IPv6 = "fd77::9/64" }, wantErr: spiderpool.ErrIncomplete, contains: "IPAM allocated fd77::5"},
		{name: "ipv4 absent but allocated", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.IPv4 = "" }, wantErr: spiderpool.ErrIncomplete, contains: "no ipv4"},
		{name: "uid mismatch", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.ReportUID = "uid-old" }, wantErr: spiderpool.ErrIncomplete, contains: "stale record"},
		{name: "uid not given skips check", mod: func(b *enivlantest.Binding, q *spiderpool.Query) { b.ReportUID = "uid-old"; q.PodUID = "" }},
		{name: "other interface", mod: func(b *enivlantest.Binding, _ *spiderpool.Query) { b.IfName = "net1" }, wantErr: spiderpool.ErrIncomplete, contains: `no interface entry for "eth0"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, q := binding(), query()
			if tt.mod != nil {
				tt.mod(&b, &q)
			}
			s, err := spiderpool.Decode(body(t, b))
			if err != nil {
				t.Fatal(err)
			}
			got, err := spiderpool.Select(s, q)
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				if got.VLAN != 100 || got.MAC.String() != "02:aa:00:00:00:05" || got.IPv4.Addr() != ip4 {
					t.Errorf("got %+v", got)
				}
				return
			}
			if !errors.Is(err, tt.wantErr) || !strings.Contains(err.Error(), tt.contains) {
				t.Errorf("error %v, want %v containing %q", err, tt.wantErr, tt.contains)
			}
		})
	}
}

func TestDecodeRequiredFields(t *testing.T) {
	b := binding()
	b.Answer = enivlantest.MissingRequired
	if _, err := spiderpool.Decode(body(t, b)); err == nil || !strings.Contains(err.Error(), "node") {
		t.Errorf("Decode without node: %v", err)
	}
	for _, in := range []string{`{}`, `[]`, `{"podNamespace":"a","podName":"b","podUID":"c","node":"d","interfaces":[{}]}`, `{"interfaces":null}`} {
		if _, err := spiderpool.Decode([]byte(in)); err == nil {
			t.Errorf("Decode(%s): want error", in)
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(body(f, binding()))
	b := binding()
	b.Answer = enivlantest.MissingVLAN
	f.Add(body(f, b))
	b = binding()
	b.VLAN = 5000
	f.Add(body(f, b))
	f.Add([]byte(`{"podNamespace":"a","podName":"b","podUID":"c","node":"d","interfaces":[{"interface":"eth0","vlan":1,"mac":"02:00:00:00:00:01","ipv4":"10.77.0.5"}]}`))
	f.Add([]byte(`{"interfaces":[null]}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		s, err := spiderpool.Decode(in)
		if err != nil {
			return
		}
		got, err := spiderpool.Select(s, query())
		if err != nil {
			if !errors.Is(err, spiderpool.ErrIncomplete) && !errors.Is(err, spiderpool.ErrInvalid) {
				t.Fatalf("unclassified error: %v", err)
			}
			return
		}
		if got.VLAN < 1 || got.VLAN > 4094 || len(got.MAC) != 6 || got.MAC[0]&1 != 0 || got.IPv4.Addr() != ip4 {
			t.Fatalf("accepted an invalid binding: %+v", got)
		}
		if got.IPv6.IsValid() && got.IPv6.Addr() != ip6 {
			t.Fatalf("accepted a mismatched ipv6: %+v", got)
		}
	})
}

// retryBudget bounds the lookups that retry until their context ends. It
// is long enough that the first answer arrives within it on a loaded
// machine (the error must carry that answer); the backoff (1–5 ms) makes
// it many attempts.
const retryBudget = 300 * time.Millisecond

func TestLookupAgainstAgent(t *testing.T) {
	a := enivlantest.StartAgent(t)
	c := spiderpool.New(a.Socket)
	c.MinBackoff, c.MaxBackoff = time.Millisecond, 5*time.Millisecond
	t.Cleanup(c.Close)

	t.Run("404 then ok", func(t *testing.T) {
		b := binding()
		b.NotFoundFirst = 3
		a.Set(b)
		got, err := c.Lookup(context.Background(), query())
		if err != nil {
			t.Fatal(err)
		}
		if got.VLAN != 100 || a.Lookups("ns", "pod") != 4 {
			t.Errorf("got %+v after %d lookups", got, a.Lookups("ns", "pod"))
		}
	})
	t.Run("binding without vlan and mac, then complete", func(t *testing.T) {
		b := binding()
		b.NotFoundFirst, b.IncompleteFirst = 1, 2
		a.Set(b)
		got, err := c.Lookup(context.Background(), query())
		if err != nil {
			t.Fatal(err)
		}
		if got.VLAN != 100 || a.Lookups("ns", "pod") != 4 {
			t.Errorf("got %+v after %d lookups", got, a.Lookups("ns", "pod"))
		}
	})
	t.Run("missing vlan until the budget ends", func(t *testing.T) {
		b := binding()
		b.Answer = enivlantest.MissingVLAN
		a.Set(b)
		ctx, cancel := context.WithTimeout(context.Background(), retryBudget)
		defer cancel()
		_, err := c.Lookup(ctx, query())
		var le *spiderpool.LookupError
		if !errors.As(err, &le) || !le.Retryable || !strings.Contains(err.Error(), `no "vlan"`) {
			t.Errorf("err %v", err)
		}
	})
	for _, tt := range []struct {
		name      string
		ans       enivlantest.Answer
		retryable bool
		contains  string
	}{
		{"500 retried", enivlantest.ServerError, true, "HTTP 500"},
		{"422 not retried", enivlantest.Unprocessable, false, "HTTP 422"},
		{"404 forever", enivlantest.NotFound, true, "HTTP 404"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := binding()
			b.Answer = tt.ans
			a.Set(b)
			ctx, cancel := context.WithTimeout(context.Background(), retryBudget)
			defer cancel()
			_, err := c.Lookup(ctx, query())
			var le *spiderpool.LookupError
			if !errors.As(err, &le) || le.Retryable != tt.retryable || !strings.Contains(err.Error(), tt.contains) {
				t.Fatalf("err %v (%+v)", err, le)
			}
			if !tt.retryable && le.Attempts != 1 {
				t.Errorf("non-retryable answer was retried %d times", le.Attempts)
			}
		})
	}
	t.Run("slow answer bounded by context", func(t *testing.T) {
		b := binding()
		b.Delay = time.Hour
		a.Set(b)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		_, err := c.Lookup(ctx, query())
		var le *spiderpool.LookupError
		if !errors.As(err, &le) || !le.Retryable || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("err %v", err)
		}
	})
	t.Run("healthy", func(t *testing.T) {
		if err := c.Healthy(context.Background()); err != nil {
			t.Fatal(err)
		}
		a.SetHealthy(false)
		defer a.SetHealthy(true)
		var se *spiderpool.StatusError
		if err := c.Healthy(context.Background()); !errors.As(err, &se) || se.Code != 500 {
			t.Errorf("unhealthy agent: %v", err)
		}
	})
}

func TestLookupAgentAbsent(t *testing.T) {
	c := spiderpool.New(t.TempDir() + "/none.sock")
	c.MinBackoff, c.MaxBackoff = time.Millisecond, 2*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := c.Lookup(ctx, query())
	var le *spiderpool.LookupError
	if !errors.As(err, &le) || !le.Retryable || !strings.Contains(err.Error(), "failed to reach spiderpool-agent") {
		t.Errorf("err %v", err)
	}
}

// BenchmarkLookupOnce is what one plugin process does: a new client, one
// Lookup answered at once, Close.
func BenchmarkLookupOnce(b *testing.B) {
	a := enivlantest.StartAgent(b)
	a.Set(binding())
	for b.Loop() {
		c := spiderpool.New(a.Socket)
		if _, err := c.Lookup(context.Background(), query()); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}
