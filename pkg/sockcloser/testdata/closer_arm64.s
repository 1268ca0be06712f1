// The socket closer's machine code (code_linux.go: closerCodeARM64), in
// Go assembler syntax; TestCloserCodeMatchesAssembler assembles it. Life: 10 s.

#include "textflag.h"

TEXT ·closer(SB), NOSPLIT|NOFRAME, $0-0
	MOVD	RSP, R19
	SUB	$512, R19, R19
	MOVD	$10, R0
	STP	(ZR, ZR), (R19)
	STP	(R0, ZR), 16(R19)
	MOVD	$0, R0
	MOVD	R19, R1
	MOVD	$0, R2
	MOVD	$103, R8
	SVC
	MOVD	$4, R0
	MOVW	$-1, R1
	MOVD	$0, R2
	MOVD	$436, R8
	SVC
	ADD	$56, R19, R1
	MOVD	$1, R2
	STP	(R1, R2), 16(R19)
	ADD	$72, R19, R1
	STP	(R1, R2), 56(R19)
	ADD	$80, R19, R1
	MOVD	R1, 32(R19)
	MOVD	ZR, 48(R19)
loop:
	MOVD	$432, R1
	MOVD	R1, 40(R19)
	MOVD	$3, R0
	MOVD	R19, R1
	MOVD	$0, R2
	MOVD	$212, R8
	SVC
	CMP	$0, R0
	BGT	loop
	CMN	$4, R0
	BEQ	loop
	NEG	R0, R0
	MOVD	$94, R8
	SVC
