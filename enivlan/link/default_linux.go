//go:build !enivlan_surrogate_link

package link

// SurrogateBanner is empty in production builds.
const SurrogateBanner = ""

// Default is the Linker of this build: a real 802.1Q VLAN link.
func Default() Linker { return VLAN{} }
