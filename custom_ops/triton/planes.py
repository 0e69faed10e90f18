"""Triton helpers for the strided bit planes of :mod:`custom_ops.formats`, and their launch-time
parameters.

Kernels hold one token-head row of ``D`` elements as a tile ``[rows, G, C_PAD]``: element
``e = g * C + c`` with ``C = D / G`` (``c < C``; ``C_PAD`` is C rounded up to a power of two so
head dims 80 and 96 work). ``G = 8 / (narrowest plane width)`` is the number of strided groups
the narrowest plane needs, so every plane maps onto the tile without moving elements: a plane of
width ``w`` has ``GP = 8 / w`` groups per byte and ``RR = G / GP`` byte runs of C bytes each;
tile group ``g = a * RR + k`` lives in bits ``[a * w, (a + 1) * w)`` of byte ``k * C + c``.
Byte ``i`` of a row sits at ``row_ptr + i * BYTE_STRIDE``: 1 for key rows, ``page_size`` for the
token-minor value rows (see :mod:`custom_ops.formats`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import triton
import triton.language as tl

from custom_ops.codebook import signed_level_values
from custom_ops.formats import Codec, Kind, KVFormat
from custom_ops.triton.traced import importable_repr

__all__ = [
    "CodecParams",
    "codec_params",
    "first_meta_column",
    "tile_offsets",
    "rotation_slice",
    "store_codes",
    "load_codes",
    "lloyd_max_levels",
]


class CodecParams(NamedTuple):
    """Compile-time description of one side (keys or values) of a format for the store and
    dequantize kernels, passed whole as one ``tl.constexpr``.

    Attributes:
        KIND: the codec's :class:`custom_ops.formats.Kind` (an int).
        BITS: code width per element.
        NC: Lloyd-Max norm correction.
        META: meta column of the side's first scalar (0 when it has none; then unused).
        W0: width of the first (low-bit) plane.
        W1: width of the second plane (0 when there is one plane).
        OFF1: byte offset of the second plane in the row.
        G: the tile's number of strided groups.
        C: ``D / G``.
        C_PAD: C rounded up to a power of two.
        RC: columns per group in one slice of the rotation (:func:`rotation_slice`): the whole
            ``C_PAD`` up to D=128; at D=256 a float32 rotation would not fit in shared memory,
            so kernels rotate in slices of ``G * RC = 64`` output elements.
        LOG2_D: ``log2(D)`` for a power-of-two head dim, whose rotation is a Walsh-Hadamard
            butterfly (:mod:`custom_ops.triton.hadamard`); 0 otherwise (products with slices
            of R).
        BYTE_STRIDE: distance between bytes of one code row (1 for keys, ``page_size`` for the
            token-minor value rows).
        LEVELS: the signed Lloyd-Max levels (:func:`custom_ops.codebook.signed_levels`), ``()``
            for other codecs.
    """

    KIND: int
    BITS: int
    NC: bool
    META: int
    W0: int
    W1: int
    OFF1: int
    G: int
    C: int
    C_PAD: int
    RC: int
    LOG2_D: int
    BYTE_STRIDE: int
    LEVELS: tuple[float, ...]

    # inductor writes constexprs into its generated code as their repr
    __repr__ = importable_repr


def first_meta_column(fmt: KVFormat, side: str) -> int:
    """Meta column of a side's first field (0 when the side has none; then it is unused)."""
    codec = fmt.key if side == "k" else fmt.value
    if not codec.meta_fields:
        return 0
    return fmt.meta_index(f"{side}_{codec.meta_fields[0]}")


def codec_levels(codec: Codec, head_dim: int) -> tuple[float, ...]:
    """The codec's signed Lloyd-Max levels as constexpr floats (``()`` if not Lloyd-Max)."""
    if codec.kind != Kind.LLOYD_MAX:
        return ()
    return signed_level_values(codec.bits, head_dim)


@functools.lru_cache(maxsize=512)
def codec_params(fmt: KVFormat, side: str, head_dim: int, byte_stride: int) -> CodecParams:
    """The :class:`CodecParams` of side ``"k"`` or ``"v"`` of ``fmt`` for rows of ``head_dim``
    elements whose bytes are ``byte_stride`` apart."""
    codec = fmt.key if side == "k" else fmt.value
    planes = codec.planes(head_dim)
    w1 = planes[1].width if len(planes) > 1 else 0
    off1 = planes[1].offset if len(planes) > 1 else 0
    groups = 8 // min(p.width for p in planes)
    chunk = head_dim // groups
    chunk_pad = triton.next_power_of_2(chunk)
    rot_cols = chunk_pad if groups * chunk_pad <= 128 else max(1, 64 // groups)
    meta = first_meta_column(fmt, side)
    log2_d = head_dim.bit_length() - 1 if head_dim & (head_dim - 1) == 0 else 0
    return CodecParams(
        int(codec.kind),
        codec.bits,
        codec.norm_correction,
        meta,
        planes[0].width,
        w1,
        off1,
        groups,
        chunk,
        chunk_pad,
        rot_cols,
        log2_d,
        byte_stride,
        codec_levels(codec, head_dim),
    )


@triton.jit
def lloyd_max_levels(codes, P: tl.constexpr):
    """Sign-magnitude Lloyd-Max ``codes`` (int) of the codec ``P`` (anything with ``BITS`` and
    ``LEVELS``, magnitudes first) -> their float32 levels: a select per magnitude, no table in
    memory."""
    BITS: tl.constexpr = P.BITS
    magnitude = codes & ((1 << (BITS - 1)) - 1)
    level = tl.full(codes.shape, P.LEVELS[0], tl.float32)
    for m in tl.static_range(1, 1 << (BITS - 1)):
        level = tl.where(magnitude == m, tl.full(codes.shape, P.LEVELS[m], tl.float32), level)
    return tl.where(((codes >> (BITS - 1)) & 1) != 0, -level, level)


@triton.jit
def tile_offsets(G: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr):
    """Element index ``e [1, G, C_PAD]`` of each tile position and its validity mask."""
    g = tl.arange(0, G)[None, :, None]
    c = tl.arange(0, C_PAD)[None, None, :]
    return g * C + c, c < C


@triton.jit
def rotation_slice(
    rot_ptr,
    D: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    ROW0: tl.constexpr,
    RW: tl.constexpr,
    COL0: tl.constexpr,
    CW: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """A block of the +-1 rotation between tile positions, for ``tl.dot``: ``[RW, G * CW]``.

    Rows are the tile positions ``ROW0 .. ROW0 + RW`` (of ``G * C_PAD``), columns the positions
    ``(g, COL0 + c)``; entry ``R[elem(row), elem(col)]`` (``R[elem(col), elem(row)]`` with
    ``TRANSPOSE``), zero at padding. Kernels multiply by the rotation block by block so that a
    float32 rotation never has to sit in registers or shared memory whole.
    """
    i = ROW0 + tl.arange(0, RW)
    i_elem = (i // C_PAD) * C + i % C_PAD
    i_ok = (i % C_PAD) < C
    j = tl.arange(0, G * CW)
    j_col = COL0 + j % CW
    j_elem = (j // CW) * C + j_col
    j_ok = j_col < C
    if TRANSPOSE:
        offsets = j_elem[None, :] * D + i_elem[:, None]
    else:
        offsets = i_elem[:, None] * D + j_elem[None, :]
    return tl.load(rot_ptr + offsets, mask=i_ok[:, None] & j_ok[None, :], other=0.0)


@triton.jit
def _store_plane(
    codes,
    row_ptr,
    row_mask,
    BYTE_STRIDE: tl.constexpr,
    WIDTH: tl.constexpr,
    SHIFT: tl.constexpr,
    OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    COL0: tl.constexpr,
    CW: tl.constexpr,
):
    GP: tl.constexpr = 8 // WIDTH
    RR: tl.constexpr = G // GP
    bits = (codes >> SHIFT) & ((1 << WIDTH) - 1)
    bits = tl.reshape(bits, (ROWS, GP, RR, CW))
    shifts = (tl.arange(0, GP) * WIDTH)[None, :, None, None]
    packed = tl.sum(bits << shifts, axis=1)  # [ROWS, RR, CW]
    k = tl.arange(0, RR)[None, :, None]
    c = COL0 + tl.arange(0, CW)[None, None, :]
    mask = row_mask[:, None, None] & (c < C)
    byte = OFFSET + k * C + c
    tl.store(row_ptr[:, None, None] + byte * BYTE_STRIDE, packed.to(tl.uint8), mask=mask)


@triton.jit
def store_codes(
    codes,
    row_ptr,
    row_mask,
    P: tl.constexpr,
    ROWS: tl.constexpr,
    COL0: tl.constexpr,
    CW: tl.constexpr,
):
    """Pack the tile slice ``codes [ROWS, G, CW] int32`` (columns ``COL0 + c``) into the planes
    of the rows starting at ``row_ptr`` (bytes ``P.BYTE_STRIDE`` apart) of the codec ``P``
    (:class:`CodecParams`)."""
    _store_plane(codes, row_ptr, row_mask, P.BYTE_STRIDE, P.W0, 0, 0, ROWS, P.G, P.C, COL0, CW)
    if P.W1 > 0:
        _store_plane(
            codes, row_ptr, row_mask, P.BYTE_STRIDE, P.W1, P.W0, P.OFF1, ROWS, P.G, P.C, COL0, CW
        )


@triton.jit
def _load_plane(
    row_ptr,
    row_mask,
    BYTE_STRIDE: tl.constexpr,
    WIDTH: tl.constexpr,
    OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
):
    GP: tl.constexpr = 8 // WIDTH
    RR: tl.constexpr = G // GP
    k = tl.arange(0, RR)[None, :, None]
    c = tl.arange(0, C_PAD)[None, None, :]
    mask = row_mask[:, None, None] & (c < C)
    byte = OFFSET + k * C + c
    packed = tl.load(row_ptr[:, None, None] + byte * BYTE_STRIDE, mask=mask, other=0)
    shifts = (tl.arange(0, GP) * WIDTH)[None, :, None, None]
    bits = (packed.to(tl.int32)[:, None, :, :] >> shifts) & ((1 << WIDTH) - 1)
    return tl.reshape(bits, (ROWS, G, C_PAD))


@triton.jit
def load_codes(row_ptr, row_mask, P: tl.constexpr, ROWS: tl.constexpr):
    """Unpack the code rows at ``row_ptr`` (bytes ``P.BYTE_STRIDE`` apart) of the codec ``P``
    into ``[ROWS, G, C_PAD] int32`` (0 where masked)."""
    codes = _load_plane(row_ptr, row_mask, P.BYTE_STRIDE, P.W0, 0, ROWS, P.G, P.C, P.C_PAD)
    if P.W1 > 0:
        codes |= (
            _load_plane(row_ptr, row_mask, P.BYTE_STRIDE, P.W1, P.OFF1, ROWS, P.G, P.C, P.C_PAD)
            << P.W0
        )
    return codes
