package sockcloser

import (
	"encoding/binary"
	"runtime"
	"time"
)

// The closer is a tiny static ELF executable: an ELF header, one loadable
// read+execute segment holding the header itself and closerCode, no
// sections, no interpreter, no data (its variables live on its stack). Its
// machine code is hand-assembled in code_linux.go from the assembler
// source in testdata/closer_<arch>.s (TestCloserCodeMatchesAssembler
// checks the bytes against the Go assembler). In order, it:
//
//  1. arms a timer of its life (alarm, or setitimer(ITIMER_REAL) where
//     there is no alarm): SIGALRM's default action ends it (MaxLife);
//  2. closes every descriptor from 4 up (close_range), so that it holds
//     nothing it inherited but its stdio and the pair (descriptor 3);
//  3. loops on recvmsg(3) with a control buffer: descriptors sent with
//     SCM_RIGHTS become its own and stay open; a byte read or EINTR loops;
//  4. on EOF (the plugin exited) or an error, exits with the errno (0 on
//     EOF): the kernel closes what it holds, paying the grace periods in
//     its exit.
const (
	closerBase     = 0x400000 // load address of the image
	elfHeaderSize  = 64
	progHeaderSize = 56
	closerEntry    = closerBase + elfHeaderSize + progHeaderSize
)

// closerArch is the closer of one architecture.
type closerArch struct {
	machine uint16 // e_machine
	code    []byte
	setLife func(code []byte, secs uint16)
}

// closerArchs are the architectures with a closer image, by GOARCH.
var closerArchs = map[string]closerArch{
	"amd64": {machine: 62, code: closerCodeAMD64, setLife: setLifeAMD64},  // EM_X86_64
	"arm64": {machine: 183, code: closerCodeARM64, setLife: setLifeARM64}, // EM_AARCH64
}

// Supported reports whether this architecture has a closer image;
// without one, a plugin closes its sockets in its own process.
func Supported() bool { _, ok := closerArchs[runtime.GOARCH]; return ok }

// closerImage returns the closer executable for goarch with a life of life
// (rounded up to whole seconds, at least one); nil for an architecture
// without one.
func closerImage(goarch string, life time.Duration) []byte {
	arch, ok := closerArchs[goarch]
	if !ok {
		return nil
	}
	secs := (life + time.Second - 1) / time.Second
	secs = max(1, min(secs, 0xffff))
	code := append([]byte(nil), arch.code...)
	arch.setLife(code, uint16(secs))
	size := uint64(closerEntry - closerBase + len(code))

	img := make([]byte, 0, size)
	le := binary.LittleEndian
	// ELF header: 64-bit, little-endian, version 1, System V ABI.
	img = append(img, 0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	img = le.AppendUint16(img, 2) // e_type: ET_EXEC
	img = le.AppendUint16(img, arch.machine)
	img = le.AppendUint32(img, 1) // e_version
	img = le.AppendUint64(img, closerEntry)
	img = le.AppendUint64(img, elfHeaderSize) // e_phoff
	img = le.AppendUint64(img, 0)             // e_shoff: no sections
	img = le.AppendUint32(img, 0)             // e_flags
	img = le.AppendUint16(img, elfHeaderSize)
	img = le.AppendUint16(img, progHeaderSize)
	img = le.AppendUint16(img, 1) // e_phnum
	img = le.AppendUint16(img, 0) // e_shentsize
	img = le.AppendUint16(img, 0) // e_shnum
	img = le.AppendUint16(img, 0) // e_shstrndx
	// Program header: the whole file, loaded read+execute at closerBase.
	img = le.AppendUint32(img, 1)   // p_type: PT_LOAD
	img = le.AppendUint32(img, 4|1) // p_flags: PF_R|PF_X
	img = le.AppendUint64(img, 0)   // p_offset
	img = le.AppendUint64(img, closerBase)
	img = le.AppendUint64(img, closerBase)
	img = le.AppendUint64(img, size)    // p_filesz
	img = le.AppendUint64(img, size)    // p_memsz
	img = le.AppendUint64(img, 0x10000) // p_align: any page size up to 64 KiB
	return append(img, code...)
}
