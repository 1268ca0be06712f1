//go:build sockcloser_off

package sockcloser

// With the build tag sockcloser_off (sockclosertest.OffTag: measurements
// only, never a release build; test/closergain) no architecture has a
// closer image: Supported is false and the plugins close their sockets
// themselves, as on an architecture without one.
func init() { clear(closerArchs) }
