// Package closergain measures what pkg/sockcloser's closer process saves a
// whole-process CNI ADD, the case it exists for (pkg/sockcloser/README.md):
// BenchmarkCloserGain runs, in rounds, eni-vlan's and aether-cni's release
// binaries built as they ship and built with sockclosertest.OffTag (the
// same code closing its sockets itself, as on an architecture without a
// closer image), one ADD of each in a random order per round, so that what
// the machine does meanwhile falls on both sides alike.
package closergain
