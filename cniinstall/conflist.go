package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// PluginType is the "type" of the entry the installer chains; an entry of a
// primary with this type is aether-cni.
const PluginType = "aether-cni"

// confExtensions are the file extensions the runtime reads from the conf
// dir (containerd's go-cni and CRI-O: libcni.ConfFiles with these, sorted).
var confExtensions = []string{".conf", ".conflist", ".json"}

// IsConfName reports whether the runtime would consider a file of this name.
func IsConfName(name string) bool {
	ext := filepath.Ext(name)
	for _, e := range confExtensions {
		if ext == e {
			return true
		}
	}
	return false
}

// Skipped is a conf dir file the runtime would not load, and why.
type Skipped struct {
	// Path is the file.
	Path string
	// Err says what is wrong with it.
	Err error
}

// Primary is the runtime's primary network configuration.
type Primary struct {
	// Path is its file in the conf dir (a symlink stays the link's path).
	Path string
	// List is the plugin chain the runtime builds from it, as libcni
	// loads it: the inline "plugins", then (CNI spec 1.1, unless
	// "loadOnlyInlinedPlugins") the plugin objects of
	// <conf dir>/<network name>/*.conf in lexical order.
	List *libcni.NetworkConfigList
}

// FindPrimary returns the runtime's primary network configuration, chosen
// as containerd's CRI does (go-cni's loadFromConfDir): libcni.ConfFiles of
// dir with .conf, .conflist and .json, sorted, and the first file that
// libcni loads: a ".conflist" with libcni.ConfListFromFile (inline plugins
// and the plugin objects of the network's sub-directory), a ".conf" or
// ".json" as one plugin with a "type", up-converted with
// libcni.ConfListFromConf. It returns nil when there is none, and the
// files it skipped before the primary. A file that does not parse is
// skipped (CRI-O skips it too; go-cni fails the whole load, so containerd
// starts no pod while it is first). A symlink whose target the installer
// cannot read (not mounted into its container) is an error: the runtime
// on the host may load it, so no later file may be chained in its place.
func FindPrimary(dir string) (*Primary, []Skipped, error) {
	files, err := libcni.ConfFiles(dir, confExtensions)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to list conf dir %q: %w", dir, err)
	}
	sort.Strings(files)
	var skipped []Skipped
	for _, f := range files {
		l, err := LoadNetwork(f)
		var pe *fs.PathError
		switch {
		case err == nil:
			return &Primary{Path: f, List: l}, skipped, nil
		case errors.As(err, &pe) && pe.Path == f && isSymlink(f):
			return nil, skipped, fmt.Errorf("failed to read conf file %q: %w (a symlink whose target the installer cannot read; the runtime on the host may load it, so no later file can be chained in its place: mount the target into the installer's container or remove the link)", f, err)
		case errors.Is(err, fs.ErrNotExist) && pe != nil && pe.Path == f:
			// Removed since the listing.
		default:
			skipped = append(skipped, Skipped{Path: f, Err: err})
		}
	}
	return nil, skipped, nil
}

func isSymlink(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode()&fs.ModeSymlink != 0
}

// LoadNetwork loads one conf dir file the way containerd's go-cni does.
func LoadNetwork(path string) (*libcni.NetworkConfigList, error) {
	if isList(path) {
		l, err := libcni.ConfListFromFile(path)
		if err != nil {
			return nil, err
		}
		if len(l.Plugins) == 0 {
			return nil, errors.New("no plugins in the network")
		}
		return l, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	conf, err := libcni.NetworkPluginConfFromBytes(data) // libcni.ConfFromFile's parse, with its "type" check
	if err != nil {
		return nil, err
	}
	return libcni.ConfListFromConf(conf) //nolint:staticcheck // the up-conversion go-cni applies to a single-plugin file
}

// ChainTypes returns the plugin types of a loaded chain, in order.
func ChainTypes(l *libcni.NetworkConfigList) []string {
	types := make([]string, 0, len(l.Plugins))
	for _, p := range l.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
}

// chainHas reports whether a loaded chain runs aether-cni.
func chainHas(l *libcni.NetworkConfigList) bool {
	return slices.Contains(ChainTypes(l), PluginType)
}

// chainEndsWith reports whether aether-cni is the last plugin of a loaded chain.
func chainEndsWith(l *libcni.NetworkConfigList) bool {
	t := ChainTypes(l)
	return len(t) > 0 && t[len(t)-1] == PluginType
}

func isList(path string) bool { return strings.HasSuffix(path, ".conflist") }

// ListPath is the file a primary is written to once chained: the path
// itself for a ".conflist", else the same name with ".conflist" (a single
// plugin ".conf" or ".json" becomes a list, as istio-cni does).
func ListPath(path string) string {
	if isList(path) {
		return path
	}
	return strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
}

// span is a byte range [start, end) of a document.
type span struct{ start, end int }

// listLayout is where the plugins of a conflist are, byte for byte.
type listLayout struct {
	open    int    // offset just after the plugins array's '['
	close   int    // offset of its ']'
	plugins []span // each plugin object
	types   []string
}

// layout locates the "plugins" array of a conflist and each of its entries
// without re-encoding anything, so edits can splice bytes and leave the
// rest of the document (order, indentation, unicode, escapes) untouched.
func layout(data []byte) (*listLayout, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := expectDelim(dec, '{'); err != nil {
		return nil, err
	}
	var l *listLayout
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, _ := tok.(string)
		if key != "plugins" { // a repeated "plugins": the last wins, as in libcni
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return nil, err
			}
			continue
		}
		if err := expectDelim(dec, '['); err != nil {
			return nil, fmt.Errorf("\"plugins\" must be an array: %w", err)
		}
		l = &listLayout{open: int(dec.InputOffset())}
		for dec.More() {
			var raw json.RawMessage
			if err := dec.Decode(&raw); err != nil {
				return nil, err
			}
			end := int(dec.InputOffset())
			var p struct {
				Type string `json:"type"`
			}
			if err := json.Unmarshal(raw, &p); err != nil {
				return nil, fmt.Errorf("plugin %d must be an object: %w", len(l.plugins), err)
			}
			l.plugins = append(l.plugins, span{end - len(raw), end})
			l.types = append(l.types, p.Type)
		}
		if err := expectDelim(dec, ']'); err != nil {
			return nil, err
		}
		l.close = int(dec.InputOffset()) - 1
	}
	if err := expectDelim(dec, '}'); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the top-level object")
	}
	if l == nil {
		return nil, errors.New("no \"plugins\" array")
	}
	return l, nil
}

func expectDelim(dec *json.Decoder, want json.Delim) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("expected %q, found %v", want, tok)
	}
	return nil
}

// chains reports whether the list has an aether-cni entry.
func (l *listLayout) chains() bool {
	for _, t := range l.types {
		if t == PluginType {
			return true
		}
	}
	return false
}

// HasPlugin reports whether a conflist chains aether-cni.
func HasPlugin(data []byte) (bool, error) {
	l, err := layout(data)
	if err != nil {
		return false, err
	}
	return l.chains(), nil
}

// Insert returns the conflist with entry appended as the last plugin. The
// bytes before and after the insertion are the input's: the new entry is
// separated by a comma and the whitespace that precedes the current last
// plugin, so Remove(Insert(x)) == x. A conflist that already chains
// aether-cni is returned unchanged.
func Insert(data, entry []byte) ([]byte, error) {
	l, err := layout(data)
	if err != nil {
		return nil, err
	}
	if l.chains() {
		return data, nil
	}
	if len(l.plugins) == 0 {
		return splice(data, l.open, l.open, entry), nil
	}
	last := l.plugins[len(l.plugins)-1]
	prevEnd := l.open
	if len(l.plugins) > 1 {
		prevEnd = l.plugins[len(l.plugins)-2].end
	}
	sep := data[prevEnd:last.start]
	ws := bytes.TrimLeft(sep, ",") // whitespace before the last plugin
	if i := bytes.IndexByte(ws, ','); i >= 0 {
		ws = ws[i+1:]
	}
	ins := make([]byte, 0, 1+len(ws)+len(entry))
	ins = append(ins, ',')
	ins = append(ins, ws...)
	ins = append(ins, entry...)
	return splice(data, last.end, last.end, ins), nil
}

// Remove returns the conflist without its aether-cni entries, and whether
// there were any. An entry is cut together with the separator before it
// (after it when no other plugin precedes it), so the inverse of Insert is
// exact and everything else stays as it is.
func Remove(data []byte) ([]byte, bool, error) {
	l, err := layout(data)
	if err != nil {
		return nil, false, err
	}
	var cuts []span
	kept := 0
	for i, p := range l.plugins {
		switch {
		case l.types[i] != PluginType:
			kept++
		case kept > 0:
			cuts = append(cuts, span{l.plugins[i-1].end, p.end})
		case i+1 < len(l.plugins):
			cuts = append(cuts, span{p.start, l.plugins[i+1].start})
		default:
			cuts = append(cuts, span{l.open, p.end})
		}
	}
	if kept == 0 && len(cuts) > 0 {
		// Nothing else in the list: empty it in one cut.
		cuts = []span{{l.open, l.plugins[len(l.plugins)-1].end}}
	}
	out := data
	for i := len(cuts) - 1; i >= 0; i-- { // back to front: offsets stay valid
		out = splice(out, cuts[i].start, cuts[i].end, nil)
	}
	return out, len(cuts) > 0, nil
}

func splice(data []byte, start, end int, ins []byte) []byte {
	out := make([]byte, 0, len(data)-(end-start)+len(ins))
	out = append(out, data[:start]...)
	out = append(out, ins...)
	return append(out, data[end:]...)
}

// ConfToList turns a single plugin configuration (".conf" or ".json") into
// a conflist with the same name and cniVersion whose only plugin is the
// original object, bytes unchanged, as libcni.ConfListFromConf does. It
// sets "loadOnlyInlinedPlugins": a ".conflist" would also load the plugin
// objects of <conf dir>/<name>/, which the single-plugin file never did.
func ConfToList(conf []byte) ([]byte, error) {
	var head struct {
		Name       string `json:"name"`
		CNIVersion string `json:"cniVersion"`
	}
	if err := json.Unmarshal(conf, &head); err != nil {
		return nil, err
	}
	name, err := json.Marshal(head.Name)
	if err != nil {
		return nil, err
	}
	ver, err := json.Marshal(head.CNIVersion)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "{\n  \"cniVersion\": %s,\n  \"name\": %s,\n  \"loadOnlyInlinedPlugins\": true,\n  \"plugins\": [\n    %s\n  ]\n}\n", ver, name, bytes.TrimSpace(conf))
	return b.Bytes(), nil
}
