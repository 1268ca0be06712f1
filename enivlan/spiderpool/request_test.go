package spiderpool

import (
	"bufio"
	"bytes"
	"net/http"
	"net/url"
	"testing"
)

// TestRequest: the hand-written request is one HTTP/1.1 GET that net/http
// parses back to the path, the query (escaped where it must be) and the
// headers, and nothing follows it.
func TestRequest(t *testing.T) {
	q := url.Values{"podNamespace": {"ns"}, "podName": {"a b&c=d/é"}}
	raw := request("/v1/workloadendpoint", q)
	r := bufio.NewReader(bytes.NewReader(raw))
	req, err := http.ReadRequest(r)
	if err != nil {
		t.Fatalf("ReadRequest(%q): %v", raw, err)
	}
	if req.Method != http.MethodGet || req.Proto != "HTTP/1.1" || req.URL.Path != "/v1/workloadendpoint" {
		t.Errorf("request line: %s %s %s", req.Method, req.URL.Path, req.Proto)
	}
	if got := req.URL.Query(); got.Get("podNamespace") != "ns" || got.Get("podName") != "a b&c=d/é" || len(got) != 2 {
		t.Errorf("query %v, want %v", got, q)
	}
	if req.Host != "spiderpool-agent" || req.Header.Get("Accept") != "application/json" || !req.Close {
		t.Errorf("host %q, headers %v, close %v", req.Host, req.Header, req.Close)
	}
	if n := r.Buffered(); n != 0 {
		t.Errorf("%d bytes after the request", n)
	}
	if raw := request("/v1/ipam/healthy", nil); !bytes.HasPrefix(raw, []byte("GET /v1/ipam/healthy HTTP/1.1\r\n")) {
		t.Errorf("request without a query: %q", raw)
	}
}
