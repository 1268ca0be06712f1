// Package cniserver serves aether.cni.v1.CNIService on the agent's unix
// socket: peer uid checked with SO_PEERCRED, every request validated with
// protovalidate, one span per RPC.
package cniserver
