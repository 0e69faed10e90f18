"""A bit-exact emulator of the few PTX instructions the decode kernel's inline asm uses.

Inline asm does not run under Triton's interpreter, so the CPU tests run the asm strings here
instead: ``mov``, ``and``, ``xor``, ``shl``, ``shr``, ``mad.lo``, ``prmt`` (default mode),
``lop3``, ``sub.rn.f16x2`` and ``fma.rn.f16x2`` on 32-bit registers, and ``mov.b32 {lo, hi},
r`` into 16-bit ones.
"""

from __future__ import annotations

import re

import numpy as np


def _prmt(a: int, b: int, selector: int) -> int:
    source = a | (b << 32)
    out = 0
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        index = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def _sub_f16x2(a: int, b: int) -> int:
    x = np.array([a], dtype=np.uint32).view(np.float16)
    y = np.array([b], dtype=np.uint32).view(np.float16)
    return int((x - y).astype(np.float16).view(np.uint32)[0])


def _fma_f16x2(a: int, b: int, c: int) -> int:
    """Per 16-bit lane, ``a * b + c`` rounded once to fp16 (float64 holds the exact product and
    sum of fp16 operands whose exponents differ by less than 29 binades, as every use here)."""
    x, y, z = (
        np.array([v], dtype=np.uint32).view(np.float16).astype(np.float64) for v in (a, b, c)
    )
    return int((x * y + z).astype(np.float16).view(np.uint32)[0])


# special registers the strings read (their opaque zero, ptx._OPAQUE_ZERO): the largest
# lane and grid row
SPECIAL = {"%laneid": 31, "%ctaid.y": 65535}


def run(asm: str, inputs: dict[int, int], lane: int = SPECIAL["%laneid"]) -> dict[int, int]:
    """Run ``asm`` with ``$i`` operands preset from ``inputs`` in lane ``lane`` (``%laneid``);
    returns every ``$i`` register."""
    regs: dict[str, int] = {f"${k}": v for k, v in inputs.items()}
    special = {**SPECIAL, "%laneid": lane}

    def value(token: str) -> int:
        token = token.strip()
        if token.startswith("%"):
            return special[token]
        return int(token, 0) if token[0].isdigit() else regs[token]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        unpack = re.fullmatch(r"mov\.b32\s+\{(\S+),\s*(\S+)\},\s*(\S+)", line)
        if unpack:  # a 32-bit register's halves into two 16-bit ones
            lo, hi, src = unpack.groups()
            regs[lo], regs[hi] = value(src) & 0xFFFF, value(src) >> 16
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        vals = [value(s) for s in src]
        if op in ("mov.b32", "mov.u32"):
            result = vals[0]
        elif op in ("add.u32", "add.s32"):
            result = vals[0] + vals[1]
        elif op == "shr.s32":
            result = (vals[0] - (vals[0] >> 31 << 32)) >> vals[1]
        elif op == "and.b32":
            result = vals[0] & vals[1]
        elif op == "or.b32":
            result = vals[0] | vals[1]
        elif op == "xor.b32":
            result = vals[0] ^ vals[1]
        elif op == "shl.b32":
            result = vals[0] << vals[1]
        elif op == "shr.b32":
            result = vals[0] >> vals[1]
        elif op == "prmt.b32":
            result = _prmt(*vals)
        elif op == "lop3.b32":
            result = _lop3(*vals)
        elif op == "mad.lo.u32":
            result = vals[0] * vals[1] + vals[2]
        elif op == "sub.rn.f16x2":
            result = _sub_f16x2(*vals)
        elif op == "fma.rn.f16x2":
            result = _fma_f16x2(*vals)
        else:
            raise NotImplementedError(op)
        regs[dst] = result & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if re.fullmatch(r"\$\d+", k)}
