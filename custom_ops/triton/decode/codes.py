"""Code rows -> fp16 tensor-core operands: the decode kernels' dequantization of one tile.

The bit planes of :mod:`custom_ops.formats` are strided, so shifting a row of code bytes yields
a *contiguous part* of the head dim: 4-bit codes give two halves (low / high nibbles), 5-, 3-
and 2-bit codes four quarters (5 bits: two blocks of the 4-bit plane, two nibbles each), 8-bit
codes one part. Each part is decoded straight into its own
``tl.dot`` operand and multiplied with the matching part of the query: nothing is shuffled. On
the GPU the parts are decoded by inline PTX (:mod:`custom_ops.triton.decode.ptx`, the codec's
``ASM``); under the interpreter, which cannot run PTX, by plain Triton (``ASM == ""``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import triton
import triton.language as tl

from custom_ops.codebook import INT8_GRID_BITS, int8_key_grid
from custom_ops.formats import Codec, Kind
from custom_ops.triton.decode.ptx import (
    UINT3_SUBNORMAL_ASM,
    UINT4_SUBNORMAL_ASM,
    decode_asm,
    lut3_int8_asm,
    lut3_integer_values_asm,
    lut4_int8_asm,
    lut5_int8_asm,
    parts_of,
)
from custom_ops.triton.kinds import INT8_ABSMAX, LLOYD_MAX, UNIFORM
from custom_ops.triton.planes import codec_levels, first_meta_column, lloyd_max_levels
from custom_ops.triton.traced import importable_repr

__all__ = [
    "PartParams",
    "part_params",
    "decode_tile",
    "decode_int8_keys",
    "int8_keys",
    "subnormal_values",
    "subnormal_part_scale",
]


class PartParams(NamedTuple):
    """Compile-time description of one side of a format for the decode kernels, passed whole as
    one ``tl.constexpr``.

    Attributes:
        KIND: the codec's :class:`custom_ops.formats.Kind` (an int).
        BITS: code width per element.
        META: meta column of the side's first scalar (0 when it has none).
        OFF1: byte offset of the second bit plane (3- and 5-bit codes' sign plane), else 0.
        PARTS: contiguous parts of the head dim decoded separately (1, 2 or 4).
        PC: elements per part, ``D / PARTS``.
        PC_PAD: PC rounded up to a power of two.
        ASM: the inline PTX that decodes 4 code bytes (``""``: plain Triton).
        LEVELS: the signed Lloyd-Max levels (``()`` for other codecs).
        INT8_GRID: for 3-, 4- and 5-bit Lloyd-Max keys and 3-bit Lloyd-Max values, the
            magnitudes' ``r`` of :func:`custom_ops.codebook.int8_key_grid` (the split kernel's
            integer ``Q K^T``, and its values as integers); ``()`` otherwise.
        INT8_UNIT: that grid's unit (0.0 without one).
        ASM_INT8: the inline PTX that decodes 4 key code bytes to int8, one string (3 and 4
            bits) or one per block of the magnitude plane (5 bits); ``()``: plain Triton, or no
            grid.
        LANE_SIGNS: the int8 keys' sign plane is read as one tile (:func:`_lane_signs`) instead
            of two sign halves (3- and 5-bit keys at D 128).
        INTEGER_SCALE: for 3-bit Lloyd-Max values, the power of two ``S`` the split kernel's
            values are decoded in units of: the grid's integer ``k`` as ``k / S``
            (:func:`decode_tile` with ``INTEGERS``), ``S * INT8_UNIT`` the grid unit's 3
            significant bits, 1 to 1.75; 0.0 otherwise.
        ASM_INTEGERS: the inline PTX of that decoding (``""``: plain Triton, or none).
        ASM_SUBNORMAL: for 3- and 4-bit uniform codes, the inline PTX that decodes them to
            fp16 subnormals (:func:`decode_tile` with ``SUBNORMAL``); ``""``: plain Triton, or
            none.
    """

    KIND: int
    BITS: int
    META: int
    OFF1: int
    PARTS: int
    PC: int
    PC_PAD: int
    ASM: str
    LEVELS: tuple[float, ...]
    INT8_GRID: tuple[int, ...]
    INT8_UNIT: float
    ASM_INT8: tuple[str, ...]
    LANE_SIGNS: bool
    INTEGER_SCALE: float
    ASM_INTEGERS: str
    ASM_SUBNORMAL: str

    # inductor writes constexprs into its generated code as their repr
    __repr__ = importable_repr


def part_params(fmt, side: str, head_dim: int, fast: bool) -> PartParams:
    """The :class:`PartParams` of side ``"k"`` or ``"v"`` of ``fmt`` (``fast``: inline PTX)."""
    codec: Codec = fmt.key if side == "k" else fmt.value
    planes = codec.planes(head_dim)
    parts = parts_of(codec)
    chunk = head_dim // parts
    grid, unit, int8_asm, scale, integers_asm = (), 0.0, (), 0.0, ""
    lane_signs = False
    if side == "k" and codec.kind == Kind.LLOYD_MAX and codec.bits in INT8_GRID_BITS:
        grid, unit = int8_key_grid(codec.bits, head_dim)
        lane_signs = _lane_signs(codec.bits, head_dim)
        if fast and codec.bits == 3:
            int8_asm = (lut3_int8_asm(grid, lane_signs),)
        elif fast and codec.bits == 4:
            int8_asm = (lut4_int8_asm(grid),)
        elif fast:
            int8_asm = tuple(lut5_int8_asm(grid, block, lane_signs) for block in (0, 1))
    if side == "v" and codec.kind == Kind.LLOYD_MAX and codec.bits == 3:
        grid, unit = int8_key_grid(codec.bits, head_dim)
        # the unit's power of two (unit = c * 2**e, 1 <= c < 2): S = 2**-e
        scale = 2.0 ** (1 - math.frexp(unit)[1])
        if fast:
            integers_asm = lut3_integer_values_asm(grid, scale)
    return PartParams(
        int(codec.kind),
        codec.bits,
        first_meta_column(fmt, side),
        planes[1].offset if len(planes) > 1 else 0,
        parts,
        chunk,
        triton.next_power_of_2(chunk),
        decode_asm(codec, head_dim) if fast else "",
        codec_levels(codec, head_dim),
        grid,
        unit,
        int8_asm,
        lane_signs,
        scale,
        integers_asm,
        {4: UINT4_SUBNORMAL_ASM, 3: UINT3_SUBNORMAL_ASM}[codec.bits]
        if fast and side == "v" and subnormal_values(codec)
        else "",
    )


def subnormal_values(codec: Codec) -> bool:
    """Whether value codes of ``codec`` can enter the split kernel's products as fp16
    subnormals (:func:`decode_tile` with ``SUBNORMAL``): 3- and 4-bit uniform codes, whose
    integers are then masked in place with no conversion at all, the part accumulators
    multiplied by :func:`subnormal_part_scale` once the codes are read
    (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program). The launch plan decides
    where they do (the GPUs they were measured on)."""
    return codec.kind == Kind.UNIFORM and codec.bits in (3, 4)


@triton.constexpr_function
def subnormal_part_scale(bits: int, part: int) -> float:
    """``1 / the unit`` of value part ``part``'s subnormals: 4 bits, ``c * 2**-24`` (low
    nibbles, part 0) and ``16 c * 2**-24`` (high nibbles, part 1, masked in place; parts 2 and
    3 repeat part 0 and stay unused); 3 bits, quarter ``q`` at bits ``2q`` of its 16-bit lane,
    ``c * 2**(2q - 24)``."""
    if bits == 4:
        return 2.0**24 if part % 2 == 0 else 2.0**20
    assert bits == 3, f"subnormal values are 3- or 4-bit, got {bits}"
    return 2.0 ** (24 - 2 * part)


@triton.jit
def _subnormals(codes, BITS: tl.constexpr, PART: tl.constexpr):
    """Integer codes -> the fp16 subnormals of value part ``PART`` (plain Triton)."""
    return (codes.to(tl.float32) * (1.0 / subnormal_part_scale(BITS, PART))).to(tl.float16)


def _lane_signs(bits: int, head_dim: int) -> bool:
    """Whether 3- or 5-bit int8 keys read their sign plane as one tile (byte ``j``: the plane's
    byte ``j mod D/8``), not as two sign halves: where the plane tiles are ``D/4 = 32`` bytes,
    one row of the int8 product's operand, whose lanes hold 8 consecutive bytes each (Triton's
    ``kWidth = 8``, checked by ``tests/sm90_compile.py``), so that bytes ``j < D/8`` and ``j >=
    D/8`` are in different lanes and the strings take each lane's half from its lane id
    (:mod:`~custom_ops.triton.decode.ptx`). Half the sign tiles' shared memory and copies, one
    instruction fewer per 4 codes."""
    return bits in (3, 5) and head_dim == 128


@triton.constexpr_function
def int8_keys(int8_unit: float, part_pad: int, one_tile: bool) -> bool:
    """Whether the split kernel multiplies keys of :class:`PartParams` ``INT8_UNIT`` and
    ``PC_PAD`` as int8 (in the kernel and on the host alike): Lloyd-Max keys on an int8 grid,
    in streaming splits (a one-tile split decodes too few keys to pay for preparing the query:
    H200, 1 x 4096, 9.3 -> 10.5 us), with parts of at least 32 elements (int8 MMAs take k 32:
    3- and 5-bit keys at D 64, quarters of 16, stay fp16)."""
    return int8_unit > 0.0 and not one_tile and part_pad >= 32


@triton.jit
def _values(codes, P: tl.constexpr, INTEGERS: tl.constexpr = False):
    """Codes -> fp16 values before the per-token scalars (Lloyd-Max levels or integers;
    ``INTEGERS``: Lloyd-Max codes as the grid's integers, :func:`_grid_integers`)."""
    if INTEGERS:
        return _grid_integers(codes, P)
    if P.KIND == LLOYD_MAX:
        return lloyd_max_levels(codes.to(tl.int32), P).to(tl.float16)
    return codes.to(tl.float16)


@triton.jit
def _int8_keys(codes, P: tl.constexpr):
    """Sign-magnitude codes (int; keys, or 3-bit values) -> their int8 on the grid
    ``P.INT8_GRID``: ``r`` of the magnitude, ``~r`` for a negative code (a select per magnitude,
    as :func:`lloyd_max_levels`)."""
    SIGN: tl.constexpr = 1 << (P.BITS - 1)
    magnitude = codes & (SIGN - 1)
    r = tl.full(codes.shape, P.INT8_GRID[0], tl.int32)
    for m in tl.static_range(1, SIGN):
        r = tl.where(magnitude == m, tl.full(codes.shape, P.INT8_GRID[m], tl.int32), r)
    return tl.where((codes & SIGN) != 0, ~r, r).to(tl.int8)


@triton.jit
def _grid_integers(codes, P: tl.constexpr):
    """Sign-magnitude codes (int) -> fp16 ``k / P.INTEGER_SCALE``, ``k`` their int8 on the grid
    (:func:`_int8_keys`; exact: an integer below 2**8 in a power of two's units)."""
    return (_int8_keys(codes, P).to(tl.float32) * (1.0 / P.INTEGER_SCALE)).to(tl.float16)


@triton.jit
def decode_int8_keys(codes_ptr, row_offsets, j, mask, P: tl.constexpr, D: tl.constexpr):
    """A tile of 3-, 4- or 5-bit key code rows as the int8 operands of the integer ``Q K^T``
    (``row_offsets [N, 1]``, ``j [1, PC]`` the plane's bytes): level ``(int8 + 1/2) *
    P.INT8_UNIT``. Plain Triton gives the parts in order (4 bits: low nibbles, elements ``j``,
    and high nibbles, ``j + D/2``; 3 and 5 bits: the quarters); the inline PTX interleaves the
    two parts that one string's nibbles hold (:mod:`~custom_ops.triton.decode.ptx`'s int8
    strings: 4 bits, parts 0 and 1; 3 bits, quarters 0 and 2, 1 and 3; 5 bits, block ``c``'s
    quarters ``c`` and ``c + 2``), and the query is permuted to match
    (:func:`~custom_ops.triton.decode.query.int8_query`).

    Args:
        codes_ptr: the key codes' base (the 4-bit plane; 3 and 5 bits: the 2-bit or the
            magnitude plane, the sign plane at ``P.OFF1``).
        row_offsets: byte 0 of each token's row, ``[N, 1]``.
        j: the plane's bytes, ``[1, PC_PAD]``.
        mask: the bytes to load (``j < PC``); others read as code 0.
        P: the keys' :class:`PartParams` (with ``INT8_GRID``).
        D: the head dim.

    Returns:
        Four ``[N, PC_PAD]`` int8 tiles, the operands of parts 0-3 (4 bits: parts 2 and 3
        repeat part 0).
    """
    plane = tl.load(codes_ptr + row_offsets + j, mask=mask, other=0)
    if P.BITS == 4:
        if len(P.ASM_INT8) > 0:
            k0, k1 = tl.inline_asm_elementwise(
                P.ASM_INT8[0], "=r,=r,r", [plane], dtype=(tl.int8, tl.int8), is_pure=True, pack=4
            )
        else:
            codes = plane.to(tl.int32)
            k0 = _int8_keys(codes & 15, P)
            k1 = _int8_keys(codes >> 4, P)
        k2 = k0
        k3 = k0
    elif P.BITS == 3:
        low, high = _key_sign_tiles(codes_ptr, row_offsets, j, mask, P, D)
        if len(P.ASM_INT8) > 0:
            k0, k2, k1, k3 = tl.inline_asm_elementwise(
                P.ASM_INT8[0],
                "=r,=r,=r,=r,r,r,r",
                [plane, low, high],
                dtype=(tl.int8,) * 4,
                is_pure=True,
                pack=4,
            )
        else:
            c0, c1, c2, c3 = _lut3_codes(plane, low, high)
            k0 = _int8_keys(c0, P)
            k1 = _int8_keys(c1, P)
            k2 = _int8_keys(c2, P)
            k3 = _int8_keys(c3, P)
    else:
        second = tl.load(codes_ptr + row_offsets + j + D // 4, mask=mask, other=0)
        low, high = _key_sign_tiles(codes_ptr, row_offsets, j, mask, P, D)
        k0, k2 = _int8_lut5_block(plane, low, high, 0, P)
        k1, k3 = _int8_lut5_block(second, low, high, 1, P)
    return k0, k1, k2, k3


@triton.jit
def _key_sign_tiles(codes_ptr, row_offsets, j, mask, P: tl.constexpr, D: tl.constexpr):
    """The int8 keys' sign operands ``(low, high)``: the sign halves (:func:`_sign_halves`), or
    with ``P.LANE_SIGNS`` one tile of the sign plane (byte ``j``: its byte ``j mod D/8``),
    passed twice to the strings, which read it once and take each lane's half from its lane
    id; plain Triton splits it into the halves by ``j``."""
    D8: tl.constexpr = D // 8
    if P.LANE_SIGNS:
        signs = tl.load(codes_ptr + _sign_offsets(row_offsets, j, P, D, 1, 1), mask=mask, other=0)
        if len(P.ASM_INT8) > 0:
            low = signs
            high = signs
        else:
            low = tl.where(j < D8, signs, 0).to(tl.uint8)
            high = tl.where(j >= D8, signs, 0).to(tl.uint8)
    else:
        low, high = _sign_halves(codes_ptr, row_offsets, j, mask, P, D, 1, 1)
    return low, high


@triton.jit
def _sign_offsets(
    row_offsets,
    j,
    P: tl.constexpr,
    D: tl.constexpr,
    BYTE_STRIDE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
):
    """Offsets of the 1-bit sign plane's byte ``j mod D/8`` of each row, the tile's shape."""
    D8: tl.constexpr = D // 8
    return _hinted_offsets(row_offsets, (P.OFF1 + j % D8) * BYTE_STRIDE, TOKEN_RUN)


@triton.jit
def _hinted_offsets(row_offsets, byte_offsets, TOKEN_RUN: tl.constexpr):
    """``row_offsets + byte_offsets``, a tile (2-D, or 3-D: see :func:`decode_tile`) whose last
    axis comes in runs of ``TOKEN_RUN`` adjacent bytes (1: no runs), told to Triton (the sum
    is formed here: a hint on a function's argument is lost)."""
    offsets = row_offsets + byte_offsets
    if TOKEN_RUN > 1:
        if len(offsets.shape) == 3:
            offsets = tl.max_contiguous(
                tl.multiple_of(offsets, [1, 1, TOKEN_RUN]), [1, 1, TOKEN_RUN]
            )
        else:
            offsets = tl.max_contiguous(tl.multiple_of(offsets, [1, TOKEN_RUN]), [1, TOKEN_RUN])
    return offsets


@triton.jit
def _sign_halves(
    codes_ptr,
    row_offsets,
    j,
    mask,
    P: tl.constexpr,
    D: tl.constexpr,
    BYTE_STRIDE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
):
    """The 1-bit sign plane of 3- and 5-bit codes as two tiles that match a tile of ``D/4``
    bytes of the other plane (``j < D/4``): ``low``'s byte ``j`` is the sign plane's byte ``j``
    for ``j < D/8`` (0 elsewhere), ``high``'s byte ``j`` its byte ``j - D/8`` for ``j >= D/8``
    (0 elsewhere). Sign byte ``i``'s bit ``r`` is the top bit of element ``i + r D/8``, so
    element ``j + q D/4``'s is bit ``2q`` of ``low | high >> 1``. Both tiles are loads, never
    computed from ``j``: then Triton decodes straight in the dot operand's layout (a sign shift
    ``j // (D/8)`` as an operand sent each decoded fp16 tile through shared memory)."""
    D8: tl.constexpr = D // 8
    sign_ptrs = codes_ptr + _sign_offsets(row_offsets, j, P, D, BYTE_STRIDE, TOKEN_RUN)
    low = tl.load(sign_ptrs, mask=mask & (j < D8), other=0)
    high = tl.load(sign_ptrs, mask=mask & (j >= D8), other=0)
    return low, high


@triton.jit
def _lut3_codes(plane, low, high):
    """The 3-bit codes (int32) of the four quarters of a tile of the 2-bit plane: byte ``j``
    holds element ``j + q D/4``'s low bits at bits ``2q``, its top bit is bit ``2q`` of ``low |
    high >> 1`` (see :func:`_sign_halves`)."""
    codes = plane.to(tl.int32)
    signs = (low | (high >> 1)).to(tl.int32)
    return (
        (codes & 3) | ((signs & 1) << 2),
        ((codes >> 2) & 3) | (signs & 4),
        ((codes >> 4) & 3) | ((signs >> 2) & 4),
        ((codes >> 6) & 3) | ((signs >> 4) & 4),
    )


@triton.jit
def _lut5_codes(plane, low, high, BLOCK: tl.constexpr):
    """The 5-bit codes (int32) of quarters ``BLOCK`` and ``BLOCK + 2`` that block ``BLOCK`` of
    the 4-bit plane holds, their signs from the sign halves (:func:`_sign_halves`)."""
    signs = ((low | (high >> 1)) >> (2 * BLOCK)).to(tl.int32)
    codes = plane.to(tl.int32)
    return (codes & 15) | ((signs & 1) << 4), (codes >> 4) | (signs & 16)


@triton.jit
def _lut5_block(plane, low, high, BLOCK: tl.constexpr, P: tl.constexpr):
    """The two quarters (``BLOCK`` and ``BLOCK + 2``) of 5-bit codes that block ``BLOCK`` of the
    4-bit plane holds, their signs from the sign halves (:func:`_sign_halves`), fp16 tiles of
    ``plane``'s shape."""
    ASM: tl.constexpr = P.ASM
    if ASM != "":
        # the block's sign shift 2c as a constant operand: Triton decodes a tile whose operands
        # are loads and constants in the dot operand's layout
        low_quarter, high_quarter = tl.inline_asm_elementwise(
            ASM,
            "=r,=r,=r,=r,r,r,r,r",
            [plane, low, high, tl.full(plane.shape, 2 * BLOCK, tl.uint8)],
            dtype=(tl.float16,) * 2,
            is_pure=True,
            pack=4,
        )
    else:
        low_codes, high_codes = _lut5_codes(plane, low, high, BLOCK)
        low_quarter = _values(low_codes, P)
        high_quarter = _values(high_codes, P)
    return low_quarter, high_quarter


@triton.jit
def _int8_lut5_block(plane, low, high, BLOCK: tl.constexpr, P: tl.constexpr):
    """:func:`_lut5_block` as int8 keys on the grid ``P.INT8_GRID`` (the inline PTX's two
    outputs interleave the quarters, see :func:`decode_int8_keys`)."""
    if len(P.ASM_INT8) > 0:
        first, second = tl.inline_asm_elementwise(
            P.ASM_INT8[BLOCK],
            "=r,=r,r,r,r",
            [plane, low, high],
            dtype=(tl.int8, tl.int8),
            is_pure=True,
            pack=4,
        )
    else:
        low_codes, high_codes = _lut5_codes(plane, low, high, BLOCK)
        first = _int8_keys(low_codes, P)
        second = _int8_keys(high_codes, P)
    return first, second


@triton.jit
def decode_tile(
    codes_ptr,
    row_offsets,
    j,
    mask,
    P: tl.constexpr,
    D: tl.constexpr,
    BYTE_STRIDE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    FINITE: tl.constexpr = False,
    INTEGERS: tl.constexpr = False,
    SUBNORMAL: tl.constexpr = False,
):
    """Decode a tile of code rows of the codec ``P`` into up to four parts (fp16, the tile's
    shape, *before* the per-token scalars; unused parts repeat part 0). ``INTEGERS`` (3-bit
    Lloyd-Max codes with ``P.INTEGER_SCALE``): the grid's integers ``k / P.INTEGER_SCALE``
    instead of the levels ``(k + 1/2) * P.INT8_UNIT``. ``SUBNORMAL`` (3- and 4-bit uniform
    codes): the integers as fp16 subnormals in units of ``1 /``
    :func:`subnormal_part_scale` per part, masked in place (the products' accumulators are
    scaled back; Hopper's tensor cores take subnormal operands).

    ``row_offsets`` (offsets of byte 0 of each token's row) and ``j`` (byte of a plane part)
    broadcast to the tile: ``[N, 1]`` and ``[1, PC]`` for keys (token-major, ``BYTE_STRIDE`` 1),
    ``[1, N]`` and ``[PC, 1]`` for values (token-minor, ``BYTE_STRIDE = page_size``), whose
    tokens come in runs of ``TOKEN_RUN`` adjacent bytes (page-aligned; 1: no hint), or for
    values ``[1, 1, N]`` and ``[2, PC_PAD / 2, 1]``: the bytes in two halves. The inline
    asm packs 4 consecutive bytes of the tile's last axis: 4 elements of a key, or one byte
    column of 4 tokens of values. ``FINITE`` maps the fp8 NaN codes to finite numbers.
    """
    ASM: tl.constexpr = P.ASM
    if INTEGERS:
        tl.static_assert(P.BITS == 3 and P.INTEGER_SCALE > 0.0, "integers: 3-bit Lloyd-Max only")
    if SUBNORMAL:
        tl.static_assert(
            P.KIND == UNIFORM and (P.BITS == 3 or P.BITS == 4), "subnormals: 3- and 4-bit uniform"
        )
    offsets = _hinted_offsets(row_offsets, j * BYTE_STRIDE, TOKEN_RUN)
    plane = tl.load(codes_ptr + offsets, mask=mask, other=0)
    if P.BITS == 4:
        # byte j: element j in the low nibble, element j + D/2 in the high nibble
        LUT4: tl.constexpr = P.ASM_SUBNORMAL if SUBNORMAL else ASM
        if LUT4 != "":
            p0, p1 = tl.inline_asm_elementwise(
                LUT4, "=r,=r,=r,=r,r", [plane], dtype=(tl.float16,) * 2, is_pure=True, pack=4
            )
        elif SUBNORMAL:
            p0 = _subnormals(plane & 15, 4, 0)
            p1 = _subnormals(plane >> 4, 4, 1)
        else:
            p0 = _values(plane & 15, P)
            p1 = _values(plane >> 4, P)
        p2 = p0
        p3 = p0
    elif P.BITS == 5:
        # block c of the 4-bit plane (bytes j + c D/4, c = 0 here, 1 in `second`): element
        # j + c D/4's magnitude in the low nibble, element j + c D/4 + D/2's in the high one,
        # quarters c and c + 2; their signs are bits 2c and 2c + 4 of low | high >> 1 (see
        # _sign_halves)
        second = tl.load(codes_ptr + offsets + (D // 4) * BYTE_STRIDE, mask=mask, other=0)
        low, high = _sign_halves(codes_ptr, row_offsets, j, mask, P, D, BYTE_STRIDE, TOKEN_RUN)
        p0, p2 = _lut5_block(plane, low, high, 0, P)
        p1, p3 = _lut5_block(second, low, high, 1, P)
    elif P.BITS == 3:
        # 2-bit plane byte j holds element j + q*D/4 at bits 2q; element j + q*D/4's top bit is
        # bit 2q of low | high >> 1 (see _sign_halves)
        low, high = _sign_halves(codes_ptr, row_offsets, j, mask, P, D, BYTE_STRIDE, TOKEN_RUN)
        LUT3: tl.constexpr = (
            P.ASM_INTEGERS if INTEGERS else (P.ASM_SUBNORMAL if SUBNORMAL else ASM)
        )
        if LUT3 != "":
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                LUT3,
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                [plane, low, high],
                dtype=(tl.float16,) * 4,
                is_pure=True,
                pack=4,
            )
        else:
            c0, c1, c2, c3 = _lut3_codes(plane, low, high)
            if SUBNORMAL:
                p0 = _subnormals(c0, 3, 0)
                p1 = _subnormals(c1, 3, 1)
                p2 = _subnormals(c2, 3, 2)
                p3 = _subnormals(c3, 3, 3)
            else:
                p0 = _values(c0, P, INTEGERS)
                p1 = _values(c1, P, INTEGERS)
                p2 = _values(c2, P, INTEGERS)
                p3 = _values(c3, P, INTEGERS)
    elif P.BITS == 2:
        # byte j holds element j + q*D/4 at bits 2q
        if ASM != "":
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                ASM,
                "=r,=r,=r,=r,=r,=r,=r,=r,r",
                [plane],
                dtype=(tl.float16,) * 4,
                is_pure=True,
                pack=4,
            )
        else:
            p0 = _values(plane & 3, P)
            p1 = _values((plane >> 2) & 3, P)
            p2 = _values((plane >> 4) & 3, P)
            p3 = _values(plane >> 6, P)
    else:
        if ASM != "":
            p0 = tl.inline_asm_elementwise(
                ASM, "=r,=r,r", [plane], dtype=tl.float16, is_pure=True, pack=4
            )
        elif P.KIND == INT8_ABSMAX:
            p0 = plane.to(tl.int8, bitcast=True).to(tl.float16)
        else:
            p0 = plane.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            if FINITE:
                # max with NaN gives the other operand; every e4m3 value is >= -448
                p0 = tl.maximum(p0, tl.full(p0.shape, -448.0, tl.float16))
        p1 = p0
        p2 = p0
        p3 = p0
    return p0, p1, p2, p3
