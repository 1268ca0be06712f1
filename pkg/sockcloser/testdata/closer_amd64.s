// The socket closer's machine code (code_linux.go: closerCodeAMD64), in
// Go assembler syntax; TestCloserCodeMatchesAssembler assembles it. Life: 10 s.

#include "textflag.h"

TEXT ·closer(SB), NOSPLIT|NOFRAME, $0-0
	MOVL	$37, AX
	MOVL	$10, DI
	SYSCALL
	MOVL	$436, AX
	MOVL	$4, DI
	MOVL	$-1, SI
	XORL	DX, DX
	SYSCALL
	LEAQ	-512(SP), BX
	XORL	AX, AX
	MOVQ	AX, 0(BX)
	MOVQ	AX, 8(BX)
	MOVQ	AX, 48(BX)
	LEAQ	56(BX), CX
	MOVQ	CX, 16(BX)
	MOVQ	$1, 24(BX)
	LEAQ	72(BX), CX
	MOVQ	CX, 56(BX)
	MOVQ	$1, 64(BX)
	LEAQ	80(BX), CX
	MOVQ	CX, 32(BX)
loop:
	MOVQ	$432, 40(BX)
	MOVL	$47, AX
	MOVL	$3, DI
	MOVQ	BX, SI
	XORL	DX, DX
	SYSCALL
	TESTQ	AX, AX
	JGT	loop
	CMPQ	AX, $-4
	JEQ	loop
	NEGL	AX
	MOVL	AX, DI
	MOVL	$231, AX
	SYSCALL
