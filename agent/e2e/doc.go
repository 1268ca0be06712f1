// Package e2e runs the aether-agent binary as a separate process and talks
// to it over its real unix sockets.
package e2e
