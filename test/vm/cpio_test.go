package vm

import (
	"bytes"
	"compress/gzip"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

type cpioEntry struct {
	name         string
	mode         uint32
	nlink        uint32
	major, minor uint32
	data         []byte
}

// readNewc parses a newc archive independently of the writer, checking the
// alignment rules the kernel's unpacker relies on.
func readNewc(t *testing.T, b []byte) []cpioEntry {
	t.Helper()
	var out []cpioEntry
	off := 0
	field := func(i int) uint32 {
		v, err := strconv.ParseUint(string(b[off+6+8*i:off+14+8*i]), 16, 32)
		if err != nil {
			t.Fatalf("header at %d field %d: %v", off, i, err)
		}
		return uint32(v)
	}
	for {
		if off%4 != 0 {
			t.Fatalf("header at offset %d is not 4-byte aligned", off)
		}
		if off+110 > len(b) || string(b[off:off+6]) != "070701" {
			t.Fatalf("no newc magic at offset %d", off)
		}
		e := cpioEntry{mode: field(1), nlink: field(4), major: field(9), minor: field(10)}
		size, namesize := int(field(6)), int(field(11))
		name := b[off+110 : off+110+namesize]
		if name[namesize-1] != 0 {
			t.Fatalf("name at %d not NUL-terminated", off)
		}
		e.name = string(name[:namesize-1])
		off += 110 + namesize
		off = (off + 3) &^ 3
		e.data = b[off : off+size]
		off += size
		off = (off + 3) &^ 3
		if e.name == "TRAILER!!!" {
			if off != len(b) {
				t.Fatalf("%d bytes after the trailer", len(b)-off)
			}
			return out
		}
		out = append(out, e)
	}
}

func TestArchiveWritesNewc(t *testing.T) {
	host := filepath.Join(t.TempDir(), "bin")
	payload := bytes.Repeat([]byte("abc"), 1001) // not a multiple of 4
	if err := os.WriteFile(host, payload, 0o751); err != nil {
		t.Fatal(err)
	}
	a := NewArchive()
	for _, err := range []error{
		a.File("/bin/cni/eni-vlan", host),
		a.Bytes("/etc/x.json", 0o644, []byte("{}")),
		a.Symlink("/var/run", "../run"),
		a.CharDev("/dev/console", 0o600, 5, 1),
		a.Dir("/proc", 0o555),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	var gz bytes.Buffer
	if err := a.WriteGzip(&gz); err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(&gz)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	entries := readNewc(t, raw)

	seen := map[string]cpioEntry{}
	for _, e := range entries {
		if parent := filepath.Dir(e.name); parent != "." {
			p, ok := seen[parent]
			if !ok {
				t.Errorf("%s comes before its parent %s", e.name, parent)
			} else if p.mode&0o170000 != modeDir {
				t.Errorf("parent %s of %s is not a directory", parent, e.name)
			}
		}
		seen[e.name] = e
	}
	want := map[string]struct {
		mode  uint32
		nlink uint32
		data  []byte
	}{
		"bin":              {modeDir | 0o755, 2, nil},
		"bin/cni":          {modeDir | 0o755, 2, nil},
		"bin/cni/eni-vlan": {modeFile | 0o751, 1, payload},
		"etc/x.json":       {modeFile | 0o644, 1, []byte("{}")},
		"var/run":          {modeSymlink | 0o777, 1, []byte("../run")},
		"dev/console":      {modeCharDev | 0o600, 1, nil},
		"proc":             {modeDir | 0o555, 2, nil},
	}
	for name, w := range want {
		e, ok := seen[name]
		if !ok {
			t.Errorf("%s missing from the archive", name)
			continue
		}
		if e.mode != w.mode || e.nlink != w.nlink || !bytes.Equal(e.data, w.data) {
			t.Errorf("%s: mode %o nlink %d %d bytes, want mode %o nlink %d %d bytes", name, e.mode, e.nlink, len(e.data), w.mode, w.nlink, len(w.data))
		}
	}
	if c := seen["dev/console"]; c.major != 5 || c.minor != 1 {
		t.Errorf("dev/console is %d:%d, want 5:1", c.major, c.minor)
	}
	if len(entries) != len(want)+3 { // + dev, etc, var
		t.Errorf("%d entries, want %d", len(entries), len(want)+3)
	}
}

func TestArchiveRejectsBadPaths(t *testing.T) {
	a := NewArchive()
	if err := a.Bytes("relative", 0o644, nil); err == nil {
		t.Error("a relative path was accepted")
	}
	if err := a.Bytes("/", 0o644, nil); err == nil {
		t.Error("the root was accepted as a file")
	}
	if err := a.Bytes("/etc/f", 0o644, nil); err != nil {
		t.Fatal(err)
	}
	if err := a.Bytes("/etc/f", 0o644, nil); err == nil {
		t.Error("a path added twice was accepted")
	}
	if err := a.Bytes("/etc/f/g", 0o644, nil); err == nil {
		t.Error("a file below a file was accepted")
	}
	if err := a.File("/x", filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("a missing host file was accepted")
	}
}
