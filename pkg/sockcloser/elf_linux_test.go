package sockcloser

import (
	"bytes"
	"debug/elf"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCloserImage: each closer image is a valid static executable of its
// machine: one read+execute segment covering the file, the entry at the
// code, no interpreter, the requested life in the code; an architecture
// without an image has none.
func TestCloserImage(t *testing.T) {
	for goarch, m := range map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64} {
		t.Run(goarch, func(t *testing.T) {
			img := closerImage(goarch, MaxLife)
			f, err := elf.NewFile(bytes.NewReader(img))
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			if f.Class != elf.ELFCLASS64 || f.Data != elf.ELFDATA2LSB || f.Type != elf.ET_EXEC || f.Machine != m {
				t.Errorf("header %v %v %v %v, want 64-bit little-endian executable for %v", f.Class, f.Data, f.Type, f.Machine, m)
			}
			if len(f.Progs) != 1 || len(f.Sections) != 0 {
				t.Fatalf("%d program headers, %d sections; want 1, 0", len(f.Progs), len(f.Sections))
			}
			p := f.Progs[0]
			if p.Type != elf.PT_LOAD || p.Flags != elf.PF_R|elf.PF_X || p.Off != 0 || p.Filesz != uint64(len(img)) || p.Memsz != p.Filesz {
				t.Errorf("segment %+v, want the whole file (%d bytes), read+execute", p.ProgHeader, len(img))
			}
			code := closerArchs[goarch].code
			if f.Entry != p.Vaddr+uint64(len(img)-len(code)) || !bytes.HasSuffix(img, code) {
				t.Errorf("entry %#x: not at the code (segment at %#x, %d bytes, code %d)", f.Entry, p.Vaddr, len(img), len(code))
			}
			short := closerImage(goarch, 1500*time.Millisecond)
			if bytes.Equal(short, img) || len(short) != len(img) {
				t.Error("the life is not in the image")
			}
			if !bytes.Equal(closerImage(goarch, 10*time.Second), img) {
				t.Errorf("MaxLife %v is not the 10 s of testdata/closer_%s.s", MaxLife, goarch)
			}
		})
	}
	if img := closerImage("riscv64", MaxLife); img != nil {
		t.Errorf("riscv64 has an image of %d bytes, want none", len(img))
	}
}

// TestCloserCodeMatchesAssembler: the hand-assembled code of each
// architecture is what the Go assembler makes of testdata/closer_<arch>.s
// (the same instructions in its syntax; life 10 s).
func TestCloserCodeMatchesAssembler(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go tool is needed to assemble the closer: %v", err)
	}
	out, err := exec.Command(goBin, "env", "GOROOT").Output()
	if err != nil {
		t.Fatalf("go env GOROOT: %v", err)
	}
	include := filepath.Join(strings.TrimSpace(string(out)), "pkg", "include")
	for goarch, arch := range closerArchs {
		t.Run(goarch, func(t *testing.T) {
			src, err := filepath.Abs(filepath.Join("testdata", "closer_"+goarch+".s"))
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(goBin, "tool", "asm", "-p", "main", "-I", include, "-S", "-o", filepath.Join(t.TempDir(), "closer.o"), src)
			cmd.Env = append(os.Environ(), "GOOS=linux", "GOARCH="+goarch)
			listing, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("go tool asm: %v\n%s", err, listing)
			}
			got := assembled(t, string(listing))
			code := closerImage(goarch, MaxLife)[closerEntry-closerBase:]
			if len(got) < len(code) || !bytes.Equal(got[:len(code)], code) {
				t.Fatalf("closerCode for %s differs from the assembler's:\nhand:      %x\nassembler: %x", goarch, code, got)
			}
			if tail := got[len(code):]; len(bytes.Trim(tail, "\x00")) != 0 {
				t.Errorf("the assembler made %d bytes more than the hand-assembled code: %x", len(tail), tail)
			}
			if !bytes.Equal(arch.code, code) {
				t.Error("closerImage changed the code beyond its life")
			}
		})
	}
}

// assembled returns the bytes of the hex dump in an assembler listing
// (go tool asm -S): lines "\t0x0010 0f 05 ...  ascii", 16 bytes each.
func assembled(t *testing.T, listing string) []byte {
	t.Helper()
	var code []byte
	for _, l := range strings.Split(listing, "\n") {
		rest, ok := strings.CutPrefix(l, "\t0x")
		if !ok || len(rest) < 4+3 || rest[4] != ' ' || rest[7] != ' ' {
			continue // an instruction line: "\t0x0000 00000 (file:line) ..."
		}
		rest = rest[4:]
		for n := 0; n < 16 && len(rest) >= 3 && rest[0] == ' ' && rest[1] != ' '; n++ {
			b, err := hex.DecodeString(rest[1:3])
			if err != nil {
				t.Fatalf("listing line %q: %v", l, err)
			}
			code = append(code, b...)
			rest = rest[3:]
		}
	}
	if len(code) == 0 {
		t.Fatalf("no code in the listing:\n%s", listing)
	}
	return code
}
