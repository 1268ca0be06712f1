// Package spiderpool is a small client of spiderpool-agent's unix-socket API:
// GetWorkloadEndpoint (GET /v1/workloadendpoint?podNamespace=&podName=) and
// the health check (GET /v1/ipam/healthy).
//
// Each call is one HTTP/1.1 request on its own unix-socket connection, with
// no http.Transport (a plugin process makes one or two calls, and a
// Transport's pool, per-connection goroutines and HTTP/2 set-up cost more
// than they save there): the request is written out by hand, the response
// read with net/http's ReadResponse. Dial, write and read are bounded by
// the caller's context, so a hung or absent agent is too.
//
// It validates what the agent returns: the agent reads an informer cache
// that lags the IPAM write, and omits "vlan" when 0 and "mac" when empty,
// so an answer is only a binding once it names a VLAN in 1..4094, a
// unicast MAC, the IPs IPAM allocated and the pod's UID.
package spiderpool

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"
)

// Route is one route of an interface entry (all fields required by the API).
type Route struct {
	// IfName is the interface the route belongs to.
	IfName string `json:"ifName"`
	// Dst is the destination CIDR.
	Dst string `json:"dst"`
	// Gw is the next hop.
	Gw string `json:"gw"`
}

// InterfaceDetail mirrors spiderpool's models.InterfaceDetail.
// Field names and JSON keys follow api/v1/agent/openapi.yaml; vlan and mac
// are omitted by the agent when zero/empty.
type InterfaceDetail struct {
	// Interface is the pod interface name (required).
	Interface   *string  `json:"interface"`
	IPv4        string   `json:"ipv4,omitempty"`
	IPv6        string   `json:"ipv6,omitempty"`
	IPv4Gateway string   `json:"ipv4Gateway,omitempty"`
	IPv6Gateway string   `json:"ipv6Gateway,omitempty"`
	IPv4Pool    string   `json:"ipv4Pool,omitempty"`
	IPv6Pool    string   `json:"ipv6Pool,omitempty"`
	MAC         string   `json:"mac,omitempty"`
	VLAN        int64    `json:"vlan,omitempty"`
	Routes      []*Route `json:"routes,omitempty"`
}

// WorkloadEndpointStatus mirrors spiderpool's models.WorkloadEndpointStatus.
// Every field is required by the API.
type WorkloadEndpointStatus struct {
	// PodNamespace, PodName, PodUID and Node identify the pod.
	PodNamespace *string            `json:"podNamespace"`
	PodName      *string            `json:"podName"`
	PodUID       *string            `json:"podUID"`
	Node         *string            `json:"node"`
	Interfaces   []*InterfaceDetail `json:"interfaces"`
}

// Query says which pod and interface to look up and what IPAM allocated.
type Query struct {
	// PodNamespace and PodName are K8S_POD_NAMESPACE and K8S_POD_NAME.
	PodNamespace, PodName string
	// PodUID is K8S_POD_UID; empty skips the UID cross-check.
	PodUID string
	// IfName is CNI_IFNAME; the entry with this "interface" is picked.
	IfName string
	// IPv4 and IPv6 are the addresses IPAM allocated (invalid = none).
	IPv4, IPv6 netip.Addr
}

// Binding is a validated cloud binding for one interface.
type Binding struct {
	// VLAN is the 802.1Q VLAN ID, 1..4094.
	VLAN int
	// MAC is the sub-ENI's unicast MAC.
	MAC net.HardwareAddr
	// IPv4 and IPv6 are the addresses the agent reports (may be invalid).
	IPv4, IPv6 netip.Prefix
	// PodUID is the UID the agent reports.
	PodUID string
}

// ErrIncomplete marks an answer that may still become valid (404, missing
// vlan or mac, stale record): the lookup is retried within its budget.
var ErrIncomplete = errors.New("workload endpoint not ready")

// ErrInvalid marks an answer that is complete but unusable (VLAN out of
// range, malformed MAC): it is not retried.
var ErrInvalid = errors.New("invalid workload endpoint")

// decoderSample is an answer of GET /v1/workloadendpoint naming every field
// of WorkloadEndpointStatus and of the types it holds (TestDecoderSample).
var decoderSample = []byte(`{"podNamespace":"","podName":"","podUID":"","node":"","interfaces":[{"interface":"","ipv4":"","ipv6":"","ipv4Gateway":"","ipv6Gateway":"","ipv4Pool":"","ipv6Pool":"","mac":"","vlan":0,"routes":[{"ifName":"","dst":"","gw":""}]}]}`)

// PrepareDecoder has encoding/json build its decoders for an answer of GET
// /v1/workloadendpoint (WorkloadEndpointStatus and the types it holds), so
// that Decode of the first real answer in a process does not pay for
// building them (about 0.1 ms in a fresh process). A plugin calls it while
// it waits for something else.
func PrepareDecoder() error {
	var s WorkloadEndpointStatus
	if err := json.Unmarshal(decoderSample, &s); err != nil {
		return fmt.Errorf("failed to decode the workload endpoint sample: %w", err)
	}
	return nil
}

// Decode parses a 200 body of GET /v1/workloadendpoint. Required fields of
// the API (podNamespace, podName, podUID, node, interfaces, interface) must
// be present.
func Decode(body []byte) (*WorkloadEndpointStatus, error) {
	var s WorkloadEndpointStatus
	if err := json.Unmarshal(body, &s); err != nil {
		return nil, fmt.Errorf("failed to decode workload endpoint: %w", err)
	}
	var missing []string
	for name, p := range map[string]*string{"podNamespace": s.PodNamespace, "podName": s.PodName, "podUID": s.PodUID, "node": s.Node} {
		if p == nil {
			missing = append(missing, name)
		}
	}
	if s.Interfaces == nil {
		missing = append(missing, "interfaces")
	}
	for i, in := range s.Interfaces {
		if in == nil || in.Interface == nil {
			missing = append(missing, fmt.Sprintf("interfaces[%d].interface", i))
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("failed to decode workload endpoint: required fields missing: %s", strings.Join(missing, ", "))
	}
	return &s, nil
}

// Select picks the entry for q.IfName and validates it against q. Errors
// wrap ErrIncomplete (retry) or ErrInvalid (give up).
func Select(s *WorkloadEndpointStatus, q Query) (*Binding, error) {
	if q.PodUID != "" && s.PodUID != nil && *s.PodUID != q.PodUID {
		return nil, fmt.Errorf("%w: agent reports podUID %q, K8S_POD_UID is %q (stale record)", ErrIncomplete, *s.PodUID, q.PodUID)
	}
	var in *InterfaceDetail
	var names []string
	for _, e := range s.Interfaces {
		if e == nil || e.Interface == nil {
			continue
		}
		names = append(names, *e.Interface)
		if *e.Interface == q.IfName {
			in = e
		}
	}
	if in == nil {
		return nil, fmt.Errorf("%w: no interface entry for %q (agent has %q)", ErrIncomplete, q.IfName, names)
	}
	b := &Binding{}
	if s.PodUID != nil {
		b.PodUID = *s.PodUID
	}
	if in.VLAN == 0 {
		return nil, fmt.Errorf("%w: entry for %q has no \"vlan\"", ErrIncomplete, q.IfName)
	}
	if in.VLAN < 1 || in.VLAN > 4094 {
		return nil, fmt.Errorf("%w: entry for %q has \"vlan\" %d: want 1..4094", ErrInvalid, q.IfName, in.VLAN)
	}
	b.VLAN = int(in.VLAN)
	if in.MAC == "" {
		return nil, fmt.Errorf("%w: entry for %q has no \"mac\"", ErrIncomplete, q.IfName)
	}
	mac, err := net.ParseMAC(in.MAC)
	if err != nil || len(mac) != 6 {
		return nil, fmt.Errorf("%w: entry for %q has \"mac\" %q: want six colon-separated hex bytes", ErrInvalid, q.IfName, in.MAC)
	}
	if mac[0]&1 != 0 || [6]byte(mac) == [6]byte{} {
		return nil, fmt.Errorf("%w: entry for %q has \"mac\" %q: want a unicast, non-zero MAC", ErrInvalid, q.IfName, in.MAC)
	}
	b.MAC = mac
	for _, fam := range []struct {
		name string
		got  string
		want netip.Addr
		dst  *netip.Prefix
	}{{"ipv4", in.IPv4, q.IPv4, &b.IPv4}, {"ipv6", in.IPv6, q.IPv6, &b.IPv6}} {
		if fam.got == "" {
			continue
		}
		p, err := netip.ParsePrefix(fam.got)
		if err != nil {
			a, aerr := netip.ParseAddr(fam.got)
			if aerr != nil {
				return nil, fmt.Errorf("%w: entry for %q has %q %q: want an address in CIDR form", ErrInvalid, q.IfName, fam.name, fam.got)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if fam.want.IsValid() && p.Addr().Unmap() != fam.want.Unmap() {
			return nil, fmt.Errorf("%w: entry for %q has %s %s but IPAM allocated %s (stale record)", ErrIncomplete, q.IfName, fam.name, p.Addr(), fam.want)
		}
		*fam.dst = p
	}
	if q.IPv4.IsValid() && !b.IPv4.IsValid() {
		return nil, fmt.Errorf("%w: entry for %q has no ipv4 but IPAM allocated %s", ErrIncomplete, q.IfName, q.IPv4)
	}
	return b, nil
}

// Client talks to spiderpool-agent over its unix socket.
type Client struct {
	socket string
	dialer net.Dialer
	// MinBackoff and MaxBackoff bound the retry delay of Lookup.
	MinBackoff, MaxBackoff time.Duration
}

// New returns a client of the agent listening on socket. It does no I/O.
func New(socket string) *Client {
	return &Client{socket: socket, MinBackoff: 10 * time.Millisecond, MaxBackoff: 500 * time.Millisecond}
}

// Close releases the client's resources. Every call closes its own
// connection, so there is nothing left to release; Close exists for the
// callers' interface.
func (c *Client) Close() {}

// StatusError is a non-200 answer of the agent.
type StatusError struct {
	// Code is the HTTP status.
	Code int
	// Body is the (truncated) answer.
	Body string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("spiderpool-agent answered HTTP %d: %s", e.Code, e.Body)
}

// get is one GET of path?q on a new connection ("Connection: close"),
// bounded by ctx.
func (c *Client) get(ctx context.Context, path string, q url.Values) ([]byte, error) {
	conn, err := c.dialer.DialContext(ctx, "unix", c.socket)
	if err != nil {
		return nil, fmt.Errorf("failed to reach spiderpool-agent at %q: %w", c.socket, err)
	}
	defer conn.Close()
	// The context bounds the exchange: its deadline is the connection's,
	// and its cancellation ends a blocked write or read at once.
	if d, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(d)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	resp, err := roundTrip(conn, request(path, q))
	if err != nil {
		return nil, fmt.Errorf("failed to reach spiderpool-agent at %q: %w", c.socket, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("failed to read spiderpool-agent answer to %q: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		b := strings.TrimSpace(string(body))
		if len(b) > 256 {
			b = b[:256]
		}
		return nil, &StatusError{Code: resp.StatusCode, Body: b}
	}
	return body, nil
}

// request is one GET of path?q as HTTP/1.1 bytes: the request line and
// the Host, Accept and "Connection: close" headers. The request is this
// fixed, so it is written out here; net/http's Request.Write (URL
// re-parsing, header sorting and validation) cost a plugin process ~40 µs
// of CPU for it, its first call.
func request(path string, q url.Values) []byte {
	u := url.URL{Path: path, RawQuery: q.Encode()}
	return []byte("GET " + u.RequestURI() + " HTTP/1.1\r\nHost: spiderpool-agent\r\nAccept: application/json\r\nConnection: close\r\n\r\n")
}

// roundTrip writes req on conn and reads the response header.
func roundTrip(conn net.Conn, req []byte) (*http.Response, error) {
	if _, err := conn.Write(req); err != nil {
		return nil, err
	}
	return http.ReadResponse(bufio.NewReader(conn), nil)
}

// Healthy calls GET /v1/ipam/healthy and returns nil on HTTP 200.
func (c *Client) Healthy(ctx context.Context) error {
	_, err := c.get(ctx, "/v1/ipam/healthy", nil)
	return err
}

// Get performs one GetWorkloadEndpoint call.
func (c *Client) Get(ctx context.Context, podNamespace, podName string) (*WorkloadEndpointStatus, error) {
	body, err := c.get(ctx, "/v1/workloadendpoint", url.Values{"podNamespace": {podNamespace}, "podName": {podName}})
	if err != nil {
		return nil, err
	}
	return Decode(body)
}

// retryable reports whether an error of one Get/Select round may clear up.
func retryable(err error) bool {
	var se *StatusError
	if errors.As(err, &se) {
		// 404: the informer cache has not seen the SpiderEndpoint yet;
		// 5xx: agent-side trouble. 4xx other than 404 (422 for bad
		// parameters) will not change.
		return se.Code == http.StatusNotFound || se.Code >= 500
	}
	if errors.Is(err, ErrInvalid) {
		return false
	}
	// Dial errors, missing fields and ErrIncomplete may clear up.
	return true
}

// LookupError is returned when Lookup gives up.
type LookupError struct {
	// Attempts is how many calls were made.
	Attempts int
	// Last is the last round's error.
	Last error
	// Retryable says whether the caller should report "try again later".
	Retryable bool
	// Budget is set when the context ended the lookup.
	Budget error
}

func (e *LookupError) Error() string {
	if e.Budget != nil && !errors.Is(e.Last, e.Budget) {
		return fmt.Sprintf("failed to get workload endpoint after %d attempt(s) (%v); last answer: %v", e.Attempts, e.Budget, e.Last)
	}
	return fmt.Sprintf("failed to get workload endpoint after %d attempt(s): %v", e.Attempts, e.Last)
}

func (e *LookupError) Unwrap() []error { return []error{e.Last, e.Budget} }

// Lookup calls GetWorkloadEndpoint until it yields a valid binding for q,
// retrying with exponential backoff while the answer may still change
// (404, 5xx, unreachable agent, missing vlan/mac, stale record), within
// ctx's deadline.
func (c *Client) Lookup(ctx context.Context, q Query) (*Binding, error) {
	backoff := c.MinBackoff
	attempts := 0
	var last error
	for {
		attempts++
		s, err := c.Get(ctx, q.PodNamespace, q.PodName)
		var b *Binding
		if err == nil {
			b, err = Select(s, q)
		}
		if err == nil {
			return b, nil
		}
		if !retryable(err) {
			return nil, &LookupError{Attempts: attempts, Last: err}
		}
		if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
			// The deadline has passed: the call it cut can fail (i/o
			// timeout) a moment before ctx says so.
			<-ctx.Done()
		}
		// Keep the last informative answer, not the deadline that cut a call.
		if last == nil || ctx.Err() == nil {
			last = err
		}
		if ctx.Err() != nil {
			return nil, &LookupError{Attempts: attempts, Last: last, Retryable: true, Budget: ctx.Err()}
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, &LookupError{Attempts: attempts, Last: last, Retryable: true, Budget: ctx.Err()}
		case <-t.C:
		}
		backoff = min(backoff*2, c.MaxBackoff)
	}
}
