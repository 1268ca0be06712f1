// Package capturetest holds the packet-behaviour helpers the capture and
// end-to-end tests share: transparent listeners that stand in for the
// proxy's capture port, plain listeners that stand in for real
// destinations, and a client that reports where a TCP connection or UDP
// datagram landed.
package capturetest
