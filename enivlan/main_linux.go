package enivlan

import (
	"encoding/json"
	"io"

	"github.com/containernetworking/cni/pkg/version"

	"aether.io/node/enivlan/link"
	"aether.io/node/pkg/cniutil"
)

// About is the plugin's VERSION "about" text.
const About = "eni-vlan: IaaS sub-ENI VLAN CNI plugin (spiderpool)"

// Main runs the plugin (skel dispatch on CNI_COMMAND) and returns the exit
// code. Builds with the surrogate link tag say so in the log and in VERSION.
func Main() int {
	log, closeLog := NewLogger()
	defer closeLog()
	about := About
	if link.SurrogateBanner != "" {
		about += " [" + link.SurrogateBanner + "]"
		log.Warn("TEST BUILD: surrogate link, not 802.1Q; never deploy this binary", "banner", link.SurrogateBanner)
	}
	p := New(log)
	info := SupportedVersions
	if link.SurrogateBanner != "" {
		info = surrogateInfo{SupportedVersions}
	}
	return cniutil.PluginMain(p.Verbs(), info, about, log)
}

// BuildKey is the VERSION output key a surrogate-link build adds.
const BuildKey = "eni-vlan.aether.io/build"

// surrogateInfo is VERSION's answer in a surrogate-link build: the usual
// fields plus BuildKey carrying the banner.
type surrogateInfo struct{ version.PluginInfo }

func (s surrogateInfo) Encode(w io.Writer) error {
	return json.NewEncoder(w).Encode(map[string]any{
		"cniVersion":        version.Current(),
		"supportedVersions": s.SupportedVersions(),
		BuildKey:            link.SurrogateBanner,
	})
}
