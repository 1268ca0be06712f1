// Command floor-cni is the exec floor of a Go CNI plugin: a chained plugin
// built on skel that does nothing but print its prevResult on ADD (and
// nothing on DEL). Benchmarks exec it as the peer of aether-cni.
package main

import (
	"encoding/json"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

func add(args *skel.CmdArgs) error {
	conf := &types.PluginConf{}
	if err := json.Unmarshal(args.StdinData, conf); err != nil {
		return err
	}
	if err := version.ParsePrevResult(conf); err != nil {
		return err
	}
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

func nothing(*skel.CmdArgs) error { return nil }

func main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: add, Del: nothing, Check: nothing}, version.All, "floor-cni: the exec floor")
}
