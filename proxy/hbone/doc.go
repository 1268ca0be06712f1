// Package hbone is the HBONE transport of aether-proxy: HTTP/2 CONNECT over
// mutual TLS with SPIFFE X.509-SVIDs on port 15008, wire-compatible with
// Istio ambient (ztunnel and istio.io/istio/pkg/hbone).
//
// Server terminates HBONE for one pod identity with an HTTP/2 engine of its
// own (CONNECT streams only, DATA written straight to the delivered socket)
// and hands each CONNECT stream to a Deliver callback with the verified
// source SPIFFE ID; Dialer opens CONNECT streams from a source identity over
// pooled HTTP/2 connections of a client engine of its own (Stream writes
// DATA frames straight onto the TLS connection).
// Certificates come from a Certs source (the SPIFFE Workload API watcher in
// production). See README.md for the wire format, the pool key and limits.
package hbone
