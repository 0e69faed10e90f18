"""Inline PTX that turns packed codes into fp16 operands of the decode kernel's ``tl.dot``.

Decode attention is bound by the instructions that decode codes, not by the bytes it reads; a
``tl.load(table + code)`` gather costs ~6 instructions per element, these cost 1.5 to 4.1. Each
string is used as ``tl.inline_asm_elementwise(asm, ..., pack=4)`` on ``uint8`` tiles whose
columns are byte ``j`` of a code row, so one asm instance sees 4 consecutive bytes (``j .. j+3``)
in a 32-bit register and writes, per output, 4 fp16 values in two registers (``j, j+1`` and
``j+2, j+3``). Output ``p`` is part ``p`` of the head dim (elements ``p * D/parts + j``),
following the strided bit planes of :mod:`custom_ops.formats`:

* 4 bits, one plane: byte ``j`` = element ``j`` (low nibble) and ``j + D/2`` (high nibble).
  Inputs ``$4`` (plane bytes); outputs ``$0 $1`` (low half), ``$2 $3`` (high half).
* 8 bits (int8): byte ``j`` = element ``j``. Input ``$2``; outputs ``$0 $1``.
* 3 bits, a 2-bit plane (bits ``2q`` of byte ``j``: element ``j + q D/4``) and a 1-bit plane
  (bit ``r`` of byte ``i``: the top bit of element ``i + r D/8``), which the kernel re-reads as
  two *sign halves* matching the 2-bit plane's tile: ``low`` (byte ``j`` of the 1-bit plane for
  ``j < D/8``, else 0) and ``high`` (its byte ``j - D/8`` for ``j >= D/8``, else 0), so element
  ``j + q D/4``'s top bit is bit ``2q`` of ``low | high >> 1``. Inputs ``$8`` (2-bit plane
  bytes), ``$9`` (``low``), ``$10`` (``high``); outputs ``$2q $2q+1`` for quarter ``q``. One
  32-bit shift lines up the 4 bytes' top bits (bit 7, which gets the next byte's bit 0, is never
  read).
* 5 bits, a 4-bit plane (magnitudes: byte ``i`` = element ``i`` in the low nibble, ``i + D/2``
  in the high nibble) and a 1-bit plane (bit ``r`` of byte ``i``: the sign of element ``i + r
  D/8``), read in two *blocks* of ``D/4`` plane bytes: block ``c`` (0 or 1), byte ``j`` is plane
  byte ``j + c D/4`` (elements ``j + c D/4`` and ``j + c D/4 + D/2``: quarters ``c`` and ``c +
  2``), against the sign halves of the 3-bit codes (above), whose bits ``2c`` (``low``) and
  ``2c + 1`` (``high``) hold the low nibble's sign, ``2c + 4`` and ``2c + 5`` the high one's.
  Inputs ``$4`` (plane bytes), ``$5`` (``low``), ``$6`` (``high``), ``$7`` (``2c`` in each
  byte: a constant); outputs ``$0 $1`` (the low nibbles' quarter), ``$2 $3`` (the high ones').
* 4 bits to int8 (:func:`lut4_int8_asm`, the keys of the split kernel's integer ``Q K^T``):
  input ``$2`` (plane bytes), outputs ``$0`` and ``$1``, 4 int8 each, *interleaved*: ``$0``
  holds the low and high nibbles of byte ``j`` then of byte ``j + 1`` (elements ``j``, ``j +
  D/2``, ``j + 1``, ``j + 1 + D/2``), ``$1`` those of bytes ``j + 2`` and ``j + 3``: the order
  ``prmt`` looks nibbles up in. The query operand is permuted to match
  (:func:`custom_ops.triton.decode.query.int8_query`).
* 3 bits to int8 (:func:`lut3_int8_asm`): inputs ``$4`` (2-bit plane bytes), ``$5``
  (``low``), ``$6`` (``high``); outputs ``$0 $1`` quarters 0 and 2, ``$2 $3`` quarters 1 and 3,
  each pair interleaved as the 4-bit int8 string's.
* 5 bits to int8 (:func:`lut5_int8_asm`, one string per block): a block of the 5-bit codes
  (above), inputs ``$2`` (plane bytes), ``$3`` (``low``), ``$4`` (``high``); outputs ``$0`` and
  ``$1`` interleaved as the 4-bit int8 string's: block ``c``'s quarters ``c`` and ``c + 2`` side
  by side.
* Both int8 strings at D 128 (``lane_signs``): ``low`` is one tile of the sign plane (byte
  ``j``: its byte ``j mod D/8``) and ``high`` is not read; the lane's position in the int8
  operand says which half of the row it holds, so which of each byte's bits are its signs.
* 3 bits to the grid's integers (:func:`lut3_integer_values_asm`, the split kernel's values):
  the contract of the 3-bit string above, the outputs ``k / S`` instead of the levels.
* 2 bits, one plane: bits ``2q`` of byte ``j`` = element ``j + q D/4``. Input ``$8``; outputs
  ``$2q $2q+1`` for quarter ``q``. A 4-entry fp16 table covers every code, so Lloyd-Max and
  uniform codes share one string (``lut2_asm``) with different tables.

Lloyd-Max codes are sign-magnitude: ``prmt`` looks the fp16 magnitudes up in registers (byte
tables indexed by each code's magnitude bits) and ``lop3`` ors the sign into bit 15. Uniform
codes become exact fp16 integers by or-ing them into the mantissa of 1024.0 (``0x6400``) and
subtracting 1024. ``tests/custom_ops/triton/decode/test_ptx.py`` runs every string on a bit-exact
emulator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from custom_ops.codebook import signed_level_values
from custom_ops.formats import Codec, Kind

__all__ = [
    "decode_asm",
    "lut4_asm",
    "lut3_int8_asm",
    "lut3_integer_values_asm",
    "lut4_int8_asm",
    "lut5_int8_asm",
    "lut5_asm",
    "lut3_asm",
    "lut2_asm",
    "UINT4_ASM",
    "UINT4_SUBNORMAL_ASM",
    "UINT3_ASM",
    "UINT3_SUBNORMAL_ASM",
    "INT8_ASM",
    "parts_of",
    "words_asm",
]

# lop3 truth tables, from F(a=0xF0, b=0xCC, c=0xAA)
_A_OR_B_AND_C = 0xF8  # a | (b & c)
_A_AND_B_OR_C = 0xEA  # (a & b) | c
_C_SELECTS_B_OVER_A = 0xD8  # (c & b) | (~c & a)
_A_OR_B_XOR_C = 0x56  # (a | b) ^ c


def _fp16_bits(values: Sequence[float]) -> list[int]:
    """The fp16 bit patterns of ``values`` (numpy: plans are also made while a graph is traced
    with fake tensors)."""
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16).tolist()


def _byte_tables(magnitudes: Sequence[float]) -> list[int]:
    """The ``prmt`` tables of a Lloyd-Max lookup: the fp16 ``magnitudes``' low bytes, then their
    high bytes, 4 to a 32-bit word (byte ``i`` of word ``w`` of each half: magnitude ``4w +
    i``)."""
    words = []
    for byte_shift in (0, 8):
        column = [(bits >> byte_shift) & 0xFF for bits in _fp16_bits(magnitudes)]
        words += [
            column[i] | column[i + 1] << 8 | column[i + 2] << 16 | column[i + 3] << 24
            for i in range(0, len(column), 4)
        ]
    return words


# prmt selectors over (a, b) = (bit 7 of each byte: its low nibble's flag, its high nibble's):
# nibbles 4 half .. 4 half + 3 of a word (bytes j + 2 half, j + 2 half + 1) in nibble order;
# | _REPLICATE turns each gathered bit 7 into a 0x00 / 0xFF byte (prmt's sign-replicate mode)
_NIBBLE_ORDER = (0x5140, 0x7362)
_REPLICATE = 0x8888


def _high_byte_signs(low: str, high: str, half: int) -> list[str]:
    """Set the signs of nibbles ``4 half .. 4 half + 3`` (bytes ``j + 2 half``, ``j + 2 half +
    1``) at bit 7 of ``y``'s bytes, the fp16 high bytes before the pairing: ``low`` / ``high``
    hold the low / high nibbles' signs at bit 7 of each byte, and one ``prmt`` interleaves
    them in nibble order."""
    selector = _NIBBLE_ORDER[half]
    return [
        f"prmt.b32 k, {low}, {high}, {selector:#06x};",
        f"lop3.b32 y, y, k, 0x80808080, {_A_OR_B_AND_C:#x};",
    ]


# ptxas keeps table words in uniform registers and copies one into a vector register before
# every prmt that reads it (``IMAD.U32 R, RZ, RZ, UR``). A word it cannot fold stays in a vector
# register across the loop: ``o = (laneid + ctaid.y) >> 31`` (arithmetic) is 0 (``ctaid.y <
# 2**16``) but per lane and opaque to ptxas, which merges the strings' reads of the special
# registers and rebuilds the words once per iteration; the word is ``o + word`` (an ``or`` into
# an odd word is folded: to ptxas ``o`` is 0 or -1; ``%smid`` instead of ``%ctaid.y`` is
# volatile, re-read per string). The 5-bit and 3-bit int8 key strings and the 3-bit integer
# values' use it, where it paid (tqk5v3_nc's loop 1,093 -> 955 SASS instructions per tile:
# docs/notes/2026-12-01-rotated-rows-and-the-generate-bound.md); so does the 4-bit fp16
# string (tq4_nc's values, one-tile splits' fp16 keys, the verify kernel: tq4_nc's loop 844 ->
# 789, its time within noise: docs/notes/2026-12-01-table-words-merged-and-the-fixed-cost.md).
_OPAQUE_ZERO = (
    "mov.u32 o, %laneid;",
    "mov.u32 oc, %ctaid.y;",
    "add.u32 o, o, oc;",
    "shr.s32 o, o, 31;",
)


def _opaque_words(words: dict[str, int]) -> list[str]:
    """Lines setting registers ``words`` (name -> 32-bit word) to their words through the
    opaque zero ``o`` (temporaries ``o oc``, to declare)."""
    adds = [f"add.s32 {name}, o, {word:#010x};" for name, word in words.items()]
    return [*_OPAQUE_ZERO, *adds]


def _lookup16(dst: str, tables: Sequence[str]) -> list[str]:
    """``dst``'s bytes: entry ``m``'s nibble of the 16-byte table in registers ``tables`` (4
    words: entries 0-3, .., 12-15), for the low 3 bits of ``m``'s nibbles 0-3 looked up in both
    halves and the half chosen by ``k``'s 0x00 / 0xFF bytes (each nibble's bit 3)."""
    return [
        f"prmt.b32 a, {tables[0]}, {tables[1]}, m;",
        f"prmt.b32 b, {tables[2]}, {tables[3]}, m;",
        f"lop3.b32 {dst}, a, b, k, {_C_SELECTS_B_OVER_A:#x};",
    ]


def lut4_asm(levels: Sequence[float]) -> str:
    """4-bit sign-magnitude Lloyd-Max codes -> fp16 levels (``levels``: ``[16]`` signed)."""
    tables = _byte_tables(levels[:8])  # tl0, tl1, th0, th1
    # x / y: low / high bytes of the levels of nibbles 0-3 (then 4-7) of $4, i.e. of the low
    # and high nibbles of bytes j, j+1 (then j+2, j+3); the 0x6240 / 0x7351 selectors pair each
    # level's two bytes into fp16x2 words. Signs: each nibble's bit 3 goes to bit 7 of its
    # byte of y (the fp16's bit 15) before the pairing: the low nibbles' sign bits are bit 7 of
    # s = $4 << 4's bytes, the high nibbles' bit 7 of $4's.
    lines = [
        "{",
        ".reg .b32 tl0, tl1, th0, th1, m, x, y, s, k, o, oc;",
        *_opaque_words({"tl0": tables[0], "th0": tables[2]}),
        f"mov.b32 tl1, {tables[1]:#010x};",
        f"mov.b32 th1, {tables[3]:#010x};",
        "and.b32 m, $4, 0x77777777;",
        "shl.b32 s, $4, 4;",
    ]
    for half, (lo, hi) in enumerate((("$0", "$2"), ("$1", "$3"))):
        if half:
            lines.append("shr.b32 m, m, 16;")
        lines += [
            "prmt.b32 x, tl0, tl1, m;",
            "prmt.b32 y, th0, th1, m;",
            *_high_byte_signs("s", "$4", half),
            f"prmt.b32 {lo}, x, y, 0x6240;",
            f"prmt.b32 {hi}, x, y, 0x7351;",
        ]
    return "\n".join([*lines, "}"])


def _int8_tables(grid: Sequence[int]) -> list[int]:
    """The ``prmt`` tables of an int8 lookup: the table's bytes (``r``, or ``~r`` for a signed
    table), 4 to a word."""
    return [
        sum(r << (8 * i) for i, r in enumerate(grid[w : w + 4])) for w in range(0, len(grid), 4)
    ]


def lut4_int8_asm(grid: Sequence[int]) -> str:
    """4-bit sign-magnitude Lloyd-Max codes -> int8 (``grid``: the 8 magnitudes' ``r`` of
    :func:`custom_ops.codebook.int8_key_grid`): ``r`` for a positive code, ``~r`` (``-r - 1``)
    for a negative one, so the level is ``(int8 + 1/2) * unit`` either way.

    One ``prmt`` looks 4 magnitudes up in the 8-byte table; one ``prmt`` in sign-replicate mode
    turns their 4 sign bits (bit 3 of each nibble: bit 7 of the bytes of ``$2 << 4`` for low
    nibbles, of ``$2`` for high ones) into 0x00 / 0xFF bytes, and one ``xor`` applies them:
    9 instructions per 8 codes besides the 2 table moves, against 15 besides 4 for two fp16
    outputs (:func:`lut4_asm`).

    Args:
        grid: the 8 magnitudes' ``r`` (0..127), ascending.

    Returns:
        The PTX string (input ``$2``, outputs ``$0 $1``: the interleaved order above).
    """
    lines = [
        "{",
        ".reg .b32 t0, t1, m, s, x, k;",
        # constant tables: an opaque t0 (_OPAQUE_ZERO) did not pay here
        # (docs/notes/2026-12-01-rotated-rows-and-the-generate-bound.md)
        *(f"mov.b32 t{i}, {word:#010x};" for i, word in enumerate(_int8_tables(grid))),
        "and.b32 m, $2, 0x77777777;",
        "shl.b32 s, $2, 4;",
    ]
    # nibbles 0-3 of m (bytes j, j+1), then 4-7 (bytes j+2, j+3); the masks take bit 7 of s's
    # byte (low nibble) and of $2's byte (high nibble) in nibble order, replicated
    for half, out in enumerate(("$0", "$1")):
        if half:
            lines.append("shr.b32 m, m, 16;")
        lines += [
            "prmt.b32 x, t0, t1, m;",
            f"prmt.b32 k, s, $2, {_NIBBLE_ORDER[half] | _REPLICATE:#06x};",
            f"xor.b32 {out}, x, k;",
        ]
    return "\n".join([*lines, "}"])


def _sign_bits(signs: Sequence[str]) -> list[str]:
    """Lines setting ``u``: bit ``2q`` of each byte is the sign of that byte's quarter ``q``
    (bit 7, which gets the next byte's bit 0, is never read), from the sign halves ``(low,
    high)``: ``low | high >> 1``; or from one sign tile ``(signs,)`` whose byte ``j`` is the
    sign plane's byte ``j mod D/8`` (:func:`_lane_half_lines`, in a scope of its own that
    declares its temporary). Temporary ``u``, for the caller to declare."""
    if len(signs) == 2:
        low, high = signs
        return [f"shr.b32 u, {high}, 1;", f"or.b32 u, u, {low};"]
    (tile,) = signs
    return ["{", ".reg .b32 h;", *_lane_half_lines("h"), f"shr.b32 u, {tile}, h;", "}"]


def _lane_half_lines(dst: str) -> list[str]:
    """Lines setting ``dst`` to 1 in lanes 2 and 3 of each quad, else 0: which half of a 32-byte
    int8 operand row the lane holds where Triton lays the operand out 8 consecutive bytes per
    lane (``kWidth = 8``: lane ``l`` holds bytes ``8 (l mod 4) .. 8 (l mod 4) + 7`` of each of
    its rows). At D 128 the 3- and 5-bit keys' plane tiles are such rows (``D/4 = 32`` bytes),
    so the sign bits of byte ``j`` sit one bit higher for ``j >= D/8`` than for ``j < D/8``:
    one tile of the sign plane serves both halves, shifted by the lane's half. ptxas computes
    it once, at the kernel's start (from the thread id it reads there; sm_90)."""
    return [f"mov.u32 {dst}, %laneid;", f"shr.b32 {dst}, {dst}, 1;", f"and.b32 {dst}, {dst}, 1;"]


def _lut3_int8_lines(
    table: Sequence[int], inputs: Sequence[str], outputs: Sequence[str]
) -> list[str]:
    """The lines of :func:`lut3_int8_asm` with the 8-byte ``table`` (signed: entries 0-3 for
    positive codes, 4-7 for negative ones), ``inputs`` (the plane, then ``low`` and ``high`` or
    one sign tile: :func:`_sign_bits`) and ``outputs`` (4 registers: quarters 0 and 2
    interleaved, then 1 and 3); temporaries ``t0 t1 u m x n o oc``."""
    plane, *signs = inputs
    first, second, third, fourth = outputs
    words = _int8_tables(table)
    return [
        # t0, the prmt's register operand, through the opaque zero (_OPAQUE_ZERO; the caller
        # declares o and oc); t1 an immediate
        *_opaque_words({"t0": words[0]}),
        f"mov.b32 t1, {words[1]:#010x};",
        *_sign_bits(signs),
        # quarters 0 and 2: magnitudes at bits 0-1 and 4-5, signs from bits 0 and 4 up by 2
        "shl.b32 x, u, 2;",
        "and.b32 x, x, 0x44444444;",
        f"lop3.b32 n, {plane}, 0x33333333, x, {_A_AND_B_OR_C:#x};",
        *_signed_lookup(first, second),
        # quarters 1 and 3: magnitudes down by 2, signs at bits 2 and 6 already
        "and.b32 x, u, 0x44444444;",
        f"shr.b32 m, {plane}, 2;",
        f"lop3.b32 n, m, 0x33333333, x, {_A_AND_B_OR_C:#x};",
        *_signed_lookup(third, fourth),
    ]


def lut3_int8_asm(grid: Sequence[int], lane_signs: bool = False) -> str:
    """3-bit sign-magnitude Lloyd-Max codes (the 2-bit plane and the sign halves, as
    :func:`lut3_asm` reads them) -> int8 (``grid``: the 4 magnitudes' ``r`` of
    :func:`custom_ops.codebook.int8_key_grid`), ``r`` or ``~r`` as :func:`lut4_int8_asm`.

    The plane's bits ``2q, 2q + 1`` hold quarter ``q``'s magnitude, so ``plane & 0x33333333``
    has quarters 0 and 2 as the low and high nibbles of each byte (``plane >> 2``: quarters 1
    and 3), the order :func:`lut4_int8_asm` writes; each quarter's sign (bit ``2q`` of ``low |
    high >> 1``) goes to its nibble's bit 2, and one ``prmt`` of the signed 8-byte table (``r``
    then ``~r``) decodes 4 codes: 16 instructions per 16 codes with the 2 table moves, against
    about 46 for eight fp16 outputs.

    Args:
        grid: the 4 magnitudes' ``r`` (0..127), ascending.
        lane_signs: ``$5`` is one tile of the sign plane (byte ``j``: its byte ``j mod
            D/8``), each lane's half from its position (:func:`_lane_half_lines`: D 128, the
            int8 operand's layout), and ``$6`` is not read; else the sign halves.

    Returns:
        The PTX string (inputs ``$4`` plane bytes, ``$5`` ``low``, ``$6`` ``high``, with
        ``lane_signs`` the sign tile and an unread operand; outputs
        ``$0 $1`` quarters 0 and 2, ``$2 $3`` quarters 1 and 3, interleaved).
    """
    signed = [*grid, *(~r & 0xFF for r in grid)]
    inputs = ("$4", "$5") if lane_signs else ("$4", "$5", "$6")
    lines = [
        "{",
        ".reg .b32 t0, t1, u, m, x, n, o, oc;",
        *_lut3_int8_lines(signed, inputs, ("$0", "$1", "$2", "$3")),
    ]
    return "\n".join([*lines, "}"])


def lut3_integer_values_asm(grid: Sequence[int], scale: float) -> str:
    """3-bit sign-magnitude Lloyd-Max codes -> the fp16 ``k / scale``, ``k`` the code's integer
    on the grid (``r`` or ``~r``, :func:`lut3_int8_asm`), whose level is ``(k + 1/2) * unit``:
    the same contract as :func:`lut3_asm` (inputs ``$8`` plane bytes, ``$9`` ``low``, ``$10``
    ``high``; outputs ``$2q $2q+1`` quarter ``q``, in the bytes' order).

    The split kernel's values: the level's ``1/2`` goes through the accumulators' zero term
    and ``unit * scale`` into the value multipliers, so the operand is an integer in a power
    of two's units. :func:`lut3_int8_asm`'s lookup, with the table biased by 128, gives 4 bytes
    ``k + 128`` per ``prmt``; one ``prmt`` puts two of them under the exponent of 1024
    (``0x64``: 1024 + k + 128, de-interleaving the quarters), and one ``fma.f16x2`` by ``1 /
    scale`` less ``1152 / scale`` gives ``k / scale`` exactly (``scale`` a power of two): 34
    instructions per 16 codes with the 4 constant moves, against 46 for :func:`lut3_asm`.

    Args:
        grid: the 4 magnitudes' ``r`` (0..127), ascending.
        scale: a power of two (the inverse of the grid unit's power of two).

    Returns:
        The PTX string.
    """
    biased = [*((r + 128) & 0xFF for r in grid), *((~r + 128) & 0xFF for r in grid)]
    inverse, offset = _fp16_bits([1.0 / scale, -1152.0 / scale])
    # the 4 lookups' bytes a (quarters 0 and 2 of bytes j, j + 1), b (of bytes j + 2, j + 3),
    # c and d (quarters 1 and 3); each prmt's 0x64 pairs take the even or odd bytes
    lines = [
        "{",
        ".reg .b32 t0, t1, u, m, x, n, a, b, c, d, inv, off, e, o, oc;",
        *_lut3_int8_lines(biased, ("$8", "$9", "$10"), ("a", "b", "c", "d")),
        # the exponent bytes as an opaque register (through the o above): the prmt's selector
        # then goes as an immediate (with both constants, ptxas copies the selector from a
        # uniform register)
        "add.s32 e, o, 0x64646464;",
        f"mov.b32 inv, {inverse | inverse << 16:#010x};",
        f"mov.b32 off, {offset | offset << 16:#010x};",
    ]
    for out, source, selector in (
        ("$0", "a", 0x4240),
        ("$1", "b", 0x4240),
        ("$4", "a", 0x4341),
        ("$5", "b", 0x4341),
        ("$2", "c", 0x4240),
        ("$3", "d", 0x4240),
        ("$6", "c", 0x4341),
        ("$7", "d", 0x4341),
    ):
        lines += [
            f"prmt.b32 {out}, {source}, e, {selector:#06x};",
            f"fma.rn.f16x2 {out}, {out}, inv, off;",
        ]
    return "\n".join([*lines, "}"])


def _signed_lookup(first: str, second: str) -> list[str]:
    """``first`` / ``second``: the signed table ``t0:t1``'s entries for nibbles 0-3 / 4-7 of
    ``n`` (3-bit codes, bit 3 clear)."""
    return [
        f"prmt.b32 {first}, t0, t1, n;",
        "shr.b32 n, n, 16;",
        f"prmt.b32 {second}, t0, t1, n;",
    ]


def lut5_int8_asm(grid: Sequence[int], block: int, lane_signs: bool = False) -> str:
    """Block ``block`` of 5-bit sign-magnitude Lloyd-Max codes (4-bit magnitudes and the sign
    halves, as :func:`lut5_asm` reads them) -> int8 (``grid``: the 16 magnitudes' ``r`` of
    :func:`custom_ops.codebook.int8_key_grid`), ``r`` or ``~r`` as :func:`lut4_int8_asm`.

    Two ``prmt`` look each nibble up whole, bit 3 as the sign-replicate flag: in the table of
    magnitudes 0-7 (the nibble as it is) and in that of 8-15 (bit 3 flipped). Every ``r`` is
    below 128, so a replicated byte is 0: each nibble gets its magnitude from one table and 0
    from the other, and one ``lop3`` ors the two and ``xor``-s in a byte mask of the sign (the
    same ``prmt`` mode on the sign halves, their block's bits shifted to bit 7 by immediates):
    19 instructions per 8 codes with the 4 table moves, against 40 for four fp16 outputs.

    Args:
        grid: the 16 magnitudes' ``r`` (0..127), ascending.
        block: the block ``c`` (0 or 1) of the magnitude plane.
        lane_signs: ``$3`` is one tile of the sign plane and ``$4`` is not read, as
            :func:`lut3_int8_asm`'s.

    Returns:
        The PTX string (inputs ``$2`` plane bytes, ``$3`` ``low``, ``$4`` ``high``, with
        ``lane_signs`` the sign tile and an unread operand; outputs
        ``$0 $1`` in the interleaved order).

    Raises:
        ValueError: ``grid`` not 16 magnitudes in 0..127 (above 127 a flagged lookup would not
            be 0).
    """
    if len(grid) != 16 or not all(0 <= r <= 127 for r in grid):
        raise ValueError(
            f"grid: 16 magnitudes in 0..127 (a replicated byte must be 0), got {list(grid)}"
        )
    words = _int8_tables(grid)
    lines = [
        "{",
        ".reg .b32 t0, t1, t2, t3, a, b, m, f, k, u, sl, sh, o, oc;",
        # t0 and t2: the prmt's register operands (opaque, see _OPAQUE_ZERO); t1 and t3 go
        # as immediates
        *_opaque_words({"t0": words[0], "t2": words[2]}),
        f"mov.b32 t1, {words[1]:#010x};",
        f"mov.b32 t3, {words[3]:#010x};",
        # each byte's bit 2c / 2c + 4: its low / high nibble's sign; sl / sh: those bits at
        # bit 7 of each byte
        *_sign_bits(("$3",) if lane_signs else ("$3", "$4")),
        f"shl.b32 sl, u, {7 - 2 * block};",
        f"shl.b32 sh, u, {3 - 2 * block};",
        # the nibbles as selectors of the low table ($2, then m) and, bit 3 flipped, of the
        # high one (f)
        "xor.b32 f, $2, 0x88888888;",
    ]
    for half, out in enumerate(("$0", "$1")):
        if half:
            lines += ["shr.b32 m, $2, 16;", "shr.b32 f, f, 16;"]
        lines += [
            f"prmt.b32 a, t0, t1, {'m' if half else '$2'};",
            "prmt.b32 b, t2, t3, f;",
            f"prmt.b32 k, sl, sh, {_NIBBLE_ORDER[half] | _REPLICATE:#06x};",
            f"lop3.b32 {out}, a, b, k, {_A_OR_B_XOR_C:#x};",
        ]
    return "\n".join([*lines, "}"])


def lut5_asm(levels: Sequence[float]) -> str:
    """5-bit sign-magnitude Lloyd-Max codes (a block of the 4-bit magnitude plane and the sign
    halves) -> fp16 levels (``levels``: ``[32]`` signed).

    The 16 magnitudes' low and high bytes fill two pairs of 8-byte tables each (magnitudes 0-7
    and 8-15); ``prmt`` looks each nibble's low 3 bits up in both, and a byte mask of each
    nibble's bit 3 (``prmt``'s sign-replicate mode on the plane with its low nibbles' bit 3
    moved to bit 7) selects between them. Pairing as in :func:`lut4_asm`, and the signs, as
    there, go to bit 7 of the high bytes before it.
    """
    tables = _byte_tables(levels[:16])
    lines = [
        "{",
        ".reg .b32 tl0, tl1, tl2, tl3, th0, th1, th2, th3, m, a, b, k, x, y, t, sl, sh;",
        *(
            f"mov.b32 {name}, {tables[i]:#010x};"
            for i, name in enumerate(("tl0", "tl1", "tl2", "tl3", "th0", "th1", "th2", "th3"))
        ),
        # the sign halves moved so that each byte's bit 0 / 4 is its low / high nibble's sign
        # (32-bit shifts by at most 3: the bits the next byte shifts in are never read); sl /
        # sh: those bits at bit 7 of each byte, for the low / high nibbles
        "and.b32 k, $7, 0xff;",
        "shr.b32 a, $5, k;",
        "shr.b32 t, $6, k;",
        "shr.b32 t, t, 1;",
        "or.b32 t, t, a;",
        "shl.b32 sl, t, 7;",
        "shl.b32 sh, t, 3;",
        "and.b32 m, $4, 0x77777777;",
        "shl.b32 t, $4, 4;",  # each byte's bit 3 (its low nibble's top bit) at bit 7
    ]
    # nibbles 0-3 of m: the low / high nibbles of bytes j, j+1 (then j+2, j+3); the mask takes
    # bit 7 of t's byte (low nibble) and of $4's byte (high nibble) in that order, replicated
    for half, (lo, hi) in enumerate((("$0", "$2"), ("$1", "$3"))):
        mask_selector = _NIBBLE_ORDER[half] | _REPLICATE
        if half:
            lines.append("shr.b32 m, m, 16;")
        lines += [
            f"prmt.b32 k, t, $4, {mask_selector:#06x};",
            *_lookup16("x", ("tl0", "tl1", "tl2", "tl3")),
            *_lookup16("y", ("th0", "th1", "th2", "th3")),
            *_high_byte_signs("sl", "sh", half),
            f"prmt.b32 {lo}, x, y, 0x6240;",
            f"prmt.b32 {hi}, x, y, 0x7351;",
        ]
    return "\n".join([*lines, "}"])


# 4-bit uniform codes -> exact fp16 integers. The low nibbles go under the mantissa of 1024.0
# (0x6400), 1024 + c, less 1024; the high nibbles are masked in place (bits 4-7), 1024 + 16 c,
# and one fma takes (1024 + 16 c) / 16 - 64 = c: exact (a power-of-two scale, an integer
# result), and no shift per pair.
UINT4_ASM = f"""{{
.reg .b32 t, magic, sixteenth, minus64;
mov.b32 magic, 0x64006400;
mov.b32 sixteenth, 0x2c002c00;
mov.b32 minus64, 0xd400d400;
prmt.b32 t, $4, 0, 0x4140;
lop3.b32 $0, t, 0x000F000F, magic, {_A_AND_B_OR_C:#x};
lop3.b32 $2, t, 0x00F000F0, magic, {_A_AND_B_OR_C:#x};
prmt.b32 t, $4, 0, 0x4342;
lop3.b32 $1, t, 0x000F000F, magic, {_A_AND_B_OR_C:#x};
lop3.b32 $3, t, 0x00F000F0, magic, {_A_AND_B_OR_C:#x};
sub.rn.f16x2 $0, $0, magic;
sub.rn.f16x2 $1, $1, magic;
fma.rn.f16x2 $2, $2, sixteenth, minus64;
fma.rn.f16x2 $3, $3, sixteenth, minus64;
}}"""


# 4-bit uniform codes -> fp16 subnormals, for products whose accumulators are scaled back
# afterwards: low nibbles c * 2**-24, high nibbles masked in place 16 c * 2**-24 (exact: a
# subnormal's mantissa is the integer), no arithmetic at all.
UINT4_SUBNORMAL_ASM = """{
.reg .b32 t;
prmt.b32 t, $4, 0, 0x4140;
and.b32 $0, t, 0x000F000F;
and.b32 $2, t, 0x00F000F0;
prmt.b32 t, $4, 0, 0x4342;
and.b32 $1, t, 0x000F000F;
and.b32 $3, t, 0x00F000F0;
}"""


def _shift(dst: str, src: str, left: int) -> str:
    if left > 0:
        return f"shl.b32 {dst}, {src}, {left};"
    if left < 0:
        return f"shr.b32 {dst}, {src}, {-left};"
    return f"mov.b32 {dst}, {src};"


def _quarter_lookup(q: int) -> list[str]:
    """Outputs ``$2q $2q+1`` = entries of the 4 x fp16 table ``tab0:tab1`` selected by bits
    ``2q, 2q+1`` of each byte of ``$8``: entry ``c`` is bytes ``2c, 2c+1``, so the selector
    nibble pair is ``c * 0x22 + 0x10``, computed for 4 bytes at once by one ``mad``."""
    return [
        _shift("m", "$8", -2 * q),
        "and.b32 m, m, 0x03030303;",
        "mad.lo.u32 p, m, 0x22, 0x10101010;",
        f"prmt.b32 ${2 * q}, tab0, tab1, p;",
        "shr.b32 p, p, 16;",
        f"prmt.b32 ${2 * q + 1}, tab0, tab1, p;",
    ]


# 3-bit codes: t = the sign halves $9 | $10 >> 1, whose bit 2q of each byte is the top bit of
# quarter q (bit 7 gets the next byte's bit 0 and is never read)
_SIGN_HALVES = ("shr.b32 t, $10, 1;", "or.b32 t, t, $9;")


def lut3_asm(levels: Sequence[float]) -> str:
    """3-bit sign-magnitude Lloyd-Max codes -> fp16 levels (``levels``: ``[8]`` signed).

    The 4 magnitudes fill one 8-byte table looked up by :func:`_quarter_lookup`; ``sl`` / ``sh``
    move the sign bits of ``j, j+1`` / ``j+2, j+3`` (``low | high >> 1``) under bits 15 and 31
    (up to the quarter's shift).
    """
    mags = _fp16_bits(levels[:4])
    lines = [
        "{",
        ".reg .b32 tab0, tab1, m, p, sl, sh, t;",
        f"mov.b32 tab0, {mags[0] | mags[1] << 16:#010x};",
        f"mov.b32 tab1, {mags[2] | mags[3] << 16:#010x};",
        *_SIGN_HALVES,
        "prmt.b32 sl, t, 0, 0x1404;",
        "prmt.b32 sh, t, 0, 0x3424;",
    ]
    for q in range(4):
        lo, hi = f"${2 * q}", f"${2 * q + 1}"
        lines += _quarter_lookup(q)
        lines += [
            f"shl.b32 t, sl, {7 - 2 * q};",
            f"lop3.b32 {lo}, {lo}, t, 0x80008000, {_A_OR_B_AND_C:#x};",
            f"shl.b32 t, sh, {7 - 2 * q};",
            f"lop3.b32 {hi}, {hi}, t, 0x80008000, {_A_OR_B_AND_C:#x};",
        ]
    return "\n".join([*lines, "}"])


# 3-bit uniform codes: the 2-bit plane's bytes j, j+1 (tl) and j+2, j+3 (th) in the two 16-bit
# lanes, and the sign lanes shifted left by 2 (vl, vh), whose bit 2q + 2 is quarter q's top bit
_UINT3_LANES = (
    "prmt.b32 tl, $8, 0, 0x4140;",
    "prmt.b32 th, $8, 0, 0x4342;",
    *_SIGN_HALVES,
    "prmt.b32 sl, t, 0, 0x4140;",
    "prmt.b32 sh, t, 0, 0x4342;",
    "shl.b32 vl, sl, 2;",
    "shl.b32 vh, sh, 2;",
)


def _uint3_words(q: int) -> tuple[tuple[str, str, str], ...]:
    """Quarter ``q``'s (plane lanes, top-bit lanes, output) of bytes j, j+1 and j+2, j+3."""
    return (("tl", "vl", f"${2 * q}"), ("th", "vh", f"${2 * q + 1}"))


def _uint3_asm() -> str:
    """3-bit uniform codes -> exact fp16 integers (same contract as :func:`lut3_asm`).

    Per quarter ``q`` one ``lop3`` takes bits ``2q, 2q + 1`` of the 2-bit plane's lanes and
    bit ``2q + 2`` of the sign lanes shifted left by 2 (``vl``, ``vh``), one shift brings the
    3-bit code down to bit 0 (quarter 0 needs none), and ``(x & 7) | magic`` less ``magic`` is
    its fp16 (the bits above a lane's code are masked off)."""
    lines = [
        "{",
        ".reg .b32 magic, tl, th, sl, sh, vl, vh, x, t;",
        "mov.b32 magic, 0x64006400;",
        *_UINT3_LANES,
    ]
    for q in range(4):
        plane_bits = 0x00030003 << (2 * q)
        for low_bits, top_bits, out in _uint3_words(q):
            lines.append(
                f"lop3.b32 x, {top_bits}, {low_bits}, {plane_bits:#010x}, "
                f"{_C_SELECTS_B_OVER_A:#x};"
            )
            if q:
                lines.append(_shift("x", "x", -2 * q))
            lines += [
                f"lop3.b32 {out}, x, 0x00070007, magic, {_A_AND_B_OR_C:#x};",
                f"sub.rn.f16x2 {out}, {out}, magic;",
            ]
    return "\n".join([*lines, "}"])


UINT3_ASM = _uint3_asm()


def _uint3_subnormal_asm() -> str:
    """3-bit uniform codes -> fp16 subnormals ``c * 2**(2q - 24)`` for quarter ``q`` (the
    contract of :func:`_uint3_asm` otherwise): each code selected in place by one ``lop3`` and
    masked by one ``and``, no shift and no subtraction."""
    lines = ["{", ".reg .b32 tl, th, sl, sh, vl, vh, t;", *_UINT3_LANES]
    for q in range(4):
        plane_bits = 0x00030003 << (2 * q)
        code_bits = 0x00070007 << (2 * q)
        for low_bits, top_bits, out in _uint3_words(q):
            lines += [
                f"lop3.b32 {out}, {top_bits}, {low_bits}, {plane_bits:#010x}, "
                f"{_C_SELECTS_B_OVER_A:#x};",
                f"and.b32 {out}, {out}, {code_bits:#010x};",
            ]
    return "\n".join([*lines, "}"])


UINT3_SUBNORMAL_ASM = _uint3_subnormal_asm()


def lut2_asm(table: Sequence[float]) -> str:
    """2-bit codes -> fp16 ``table[code]`` (``table``: ``[4]``; the signed levels of
    sign-magnitude Lloyd-Max codes, or 0, 1, 2, 3 for uniform codes).

    The 4 entries fill one 8-byte table looked up by :func:`_quarter_lookup`.
    """
    entries = _fp16_bits(table)
    lines = [
        "{",
        ".reg .b32 tab0, tab1, m, p;",
        f"mov.b32 tab0, {entries[0] | entries[1] << 16:#010x};",
        f"mov.b32 tab1, {entries[2] | entries[3] << 16:#010x};",
    ]
    for q in range(4):
        lines += _quarter_lookup(q)
    return "\n".join([*lines, "}"])


# int8 -> exact fp16: each byte, sign bit flipped, goes under an 0x64 high byte (1024 + 128 +
# value, since flipping the sign bit of two's complement adds 128), then 1152 (0x6480) is
# subtracted.
INT8_ASM = """{
.reg .b32 t, magic;
mov.b32 magic, 0x64806480;
prmt.b32 t, $2, 0x64646464, 0x5150;
xor.b32 $0, t, 0x00800080;
prmt.b32 t, $2, 0x64646464, 0x5352;
xor.b32 $1, t, 0x00800080;
sub.rn.f16x2 $0, $0, magic;
sub.rn.f16x2 $1, $1, magic;
}"""


def parts_of(codec: Codec) -> int:
    """How many contiguous parts of the head dim the decode kernel splits a side into: one
    ``tl.dot`` per part, each fed straight from the bit planes (2 for 4 bits, 4 for 5, 3 and 2
    bits: 5-bit codes are decoded a block of ``D/4`` plane bytes at a time, see
    :func:`lut5_asm`)."""
    return {5: 4, 4: 2, 3: 4, 2: 4}.get(codec.bits, 1)


def decode_asm(codec: Codec, head_dim: int) -> str:
    """The inline PTX that decodes one side on the GPU ("" where plain Triton is used)."""
    if codec.kind == Kind.INT8_ABSMAX:
        return INT8_ASM
    if codec.bits not in (2, 3, 4, 5):
        return ""
    if codec.bits == 2:
        if codec.kind == Kind.UNIFORM:
            return lut2_asm(range(4))
        return lut2_asm(signed_level_values(2, head_dim))
    if codec.kind == Kind.UNIFORM:
        return UINT4_ASM if codec.bits == 4 else UINT3_ASM
    builder = {5: lut5_asm, 4: lut4_asm, 3: lut3_asm}[codec.bits]
    return builder(signed_level_values(codec.bits, head_dim))


def words_asm(asm: str) -> str:
    """A 4-bit string (``lut4_asm``, ``UINT4_ASM``: bytes ``$4`` -> fp16 pairs ``$0 .. $3``) for
    the verify kernel (:mod:`custom_ops.triton.decode.verify`), which decodes whole 32-bit words:
    ``tl.inline_asm_elementwise(asm, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], pack=1)``. Input
    ``$8`` (4 code bytes); outputs ``$0 .. $3`` the fp16 of the bytes' low nibbles, ``$4 .. $7``
    of their high nibbles, one value per 16-bit register: consecutive outputs are halves of one
    32-bit register, which the kernel's operands take as they are."""
    if set(re.findall(r"\$\d+", asm)) != {"$0", "$1", "$2", "$3", "$4"}:
        raise ValueError("words_asm takes a 4-bit string with outputs $0..$3 and input $4")
    body = re.sub(
        r"\$(\d)", lambda m: "$8" if m.group(1) == "4" else f"w{m.group(1)}", asm.strip()
    )
    return (
        "{\n.reg .b32 w0, w1, w2, w3;\n"
        + body
        + "\n"
        + "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, w{i};\n" for i in range(4))
        + "}"
    )
