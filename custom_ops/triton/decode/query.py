"""The GQA group's queries as the decode kernels' tensor-core operands.

``query`` is the tuple ``(q_ptr, stride_b, stride_h)`` of the original ``q [B, Hq, D]``; a
kernel program serves the group's rows ``q_head [G_PAD]`` (``row_ok`` marks the real ones).
Scores are ``S^T = K @ Q^T``: the queries enter transposed, ``[elements, G_PAD]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.hadamard import rotate_rows

__all__ = [
    "int8_query",
    "rotated_int8_query",
    "query_part",
    "rotate_query",
    "rotated_parts",
    "original_query",
    "ring_query",
]


@triton.jit
def query_part(
    query, b, q_head, row_ok, q_scale, PART: tl.constexpr, PC: tl.constexpr, PC_PAD: tl.constexpr
):
    """Part ``PART`` of the group's unrotated queries times ``q_scale``, transposed: ``[PC_PAD,
    G_PAD]`` fp16 (keys that are not rotated need no preparation launch)."""
    q_ptr, stride_qb, stride_qh = query
    j = tl.arange(0, PC_PAD)[:, None]
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + q_head[None, :] * stride_qh
    q_part = tl.load(q_rows + PART * PC + j, mask=row_ok[None, :] & (j < PC), other=0.0)
    return (q_part.to(tl.float32) * q_scale).to(tl.float16)


@triton.jit
def rotate_query(
    query,
    rot_ptr,
    b,
    q_head,
    row_ok,
    q_scale,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """The group's queries rotated into the keys' code space, ``(q @ R / sqrt(D)) * q_scale``:
    ``[G_PAD, D]`` float32 (zero in rows that are not ``row_ok``), computed in the split kernel
    instead of by the preparation kernel (short contexts, where that launch would be on the
    critical path); :func:`rotated_parts` or :func:`rotated_int8_query` cut them into the
    keys' parts.

    For a power-of-two D, ``R = diag(s) @ H`` with ``H`` Walsh-Hadamard and ``s = R[:, 0]``, so
    ``q @ R = (q * s) @ H``: a butterfly over each query row
    (:func:`~custom_ops.triton.hadamard.rotate_rows`, float32 adds), and only R's first column
    is read.
    """
    q_ptr, stride_qb, stride_qh = query
    d = tl.arange(0, D)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
    x = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    return rotate_rows(x, rot_ptr, INV_SQRT_D * q_scale, D, LOG2_D)


@triton.jit
def _row_parts(t, PARTS: tl.constexpr, PC: tl.constexpr):
    """Whole rows ``t [G_PAD, PARTS * PC]`` (any dtype) as ``PARTS`` (2 or 4) transposed parts
    ``[PC, G_PAD]``, part ``p`` columns ``[p * PC, (p + 1) * PC)`` (unused ones repeat part
    0)."""
    G_PAD: tl.constexpr = t.shape[0]
    if PARTS == 2:
        p0, p1 = tl.split(tl.permute(tl.reshape(t, [G_PAD, 2, PC]), [2, 0, 1]))
        p2 = p0
        p3 = p0
    else:
        halves = tl.permute(tl.reshape(t, [G_PAD, 2, 2, PC]), [3, 0, 1, 2])
        low, high = tl.split(halves)  # part bit 0; [PC, G_PAD, 2] each
        p0, p2 = tl.split(low)
        p1, p3 = tl.split(high)
    return p0, p1, p2, p3


@triton.jit
def rotated_parts(y, PARTS: tl.constexpr, PC: tl.constexpr):
    """The rotated queries ``y [G_PAD, PARTS * PC]`` (:func:`rotate_query`) as ``PARTS``
    transposed parts ``[PC, G_PAD]`` fp16 (unused ones repeat part 0): contiguous ranges of
    ``PC`` outputs, split off the transposed rows."""
    tl.static_assert(PARTS > 1, "rotated keys have 2 (4-bit) or 4 (2-, 3- and 5-bit) parts")
    q0, q1, q2, q3 = _row_parts(y, PARTS, PC)
    return q0.to(tl.float16), q1.to(tl.float16), q2.to(tl.float16), q3.to(tl.float16)


@triton.jit
def _int8_steps(largest):
    """``(step, 1 / step)`` of rows whose largest magnitude is ``largest [G_PAD]`` float32:
    ``step = 2**(E - 5)`` for ``largest`` in ``[2**E, 2**(E + 1))`` (at least ``2**-126``),
    both made from the exponent bits (see :func:`int8_query`)."""
    biased = tl.maximum((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF, 6)
    step = ((biased - 5) << 23).to(tl.float32, bitcast=True)
    inv_step = ((259 - biased) << 23).to(tl.float32, bitcast=True)
    return step, inv_step


@triton.jit
def _int8_terms(z):
    """Queries ``z`` in units of ``step`` (float32, any shape) -> ``(hi, lo)``, float32 and
    integral: ``hi`` the rounded multiples of ``step``, ``lo`` the rounded remainder in units
    of ``step / 254``."""
    hi = tl.floor(z + 0.5)
    lo = tl.floor((z - hi) * 254.0 + 0.5)
    return hi, lo


@triton.jit
def _int8_pair(x, y, INTERLEAVED: tl.constexpr):
    """Two parts of the queries in units of ``step`` (``x, y [G_PAD, PC_PAD]`` float32), whose
    keys one inline-PTX instance decodes together, as ``(hi_x, hi_y, lo_x, lo_y)`` (float32,
    integral) and the rows' ``sum(254 hi + lo)`` over both; ``INTERLEAVED``: in the PTX's key
    order (column ``4g + 2b + h`` of operand ``a`` takes column ``4g + 2a + b`` of part ``h``:
    the nibbles of bytes ``j, j + 1`` low, high, low, high)."""
    if INTERLEAVED:
        G_PAD: tl.constexpr = x.shape[0]
        PC_PAD: tl.constexpr = x.shape[1]
        parts = tl.join(
            tl.reshape(x, [G_PAD, PC_PAD // 4, 2, 2]), tl.reshape(y, [G_PAD, PC_PAD // 4, 2, 2])
        )  # [G_PAD, g, a, b, h]
        x, y = tl.split(tl.reshape(tl.permute(parts, [0, 1, 3, 4, 2]), [G_PAD, PC_PAD, 2]))
    hi_x, lo_x = _int8_terms(x)
    hi_y, lo_y = _int8_terms(y)
    total = tl.sum(hi_x * 254.0 + lo_x, axis=1) + tl.sum(hi_y * 254.0 + lo_y, axis=1)
    return hi_x, hi_y, lo_x, lo_y, total


@triton.jit
def int8_query(q0, q1, q2, q3, PARTS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The parts of a group's prepared queries (``q0 .. q3 [G_PAD, PC_PAD]``, rows: the
    group's queries; ``PARTS`` 2 or 4) as int8 operands of an exact integer ``Q K^T`` with int8
    keys (:func:`~custom_ops.triton.decode.codes.decode_int8_keys`).

    Each row is ``(254 hi + lo) * step / 254``: ``step = 2**(E - 5)`` for its largest magnitude
    in ``[2**E, 2**(E + 1))``, ``hi`` the rounded multiples of ``step`` (within -64..64) and
    ``lo`` the rounded remainder in units of ``step / 254`` (within -127..127), so a query is
    kept to ``step / 508``, at most 1/16256 of its largest magnitude: finer than its fp16
    rounding. Against keys at levels ``(k + 1/2) * unit``, a score is ``(254 sum(hi k) + sum(lo
    k) + half_sum) * step * unit / 254`` with ``half_sum = sum(254 hi + lo) / 2``.

    The integer score is exact and rounds once, to float32, so the inline-PTX and plain-Triton
    paths give the same bits: ``step`` is a power of two (made from the exponent bits; a division
    would round differently on the GPU and under the interpreter), the fp16 queries times ``1 /
    step`` keep 11 significant bits, so ``(x - hi) * 254`` is exact; ``half_sum`` is an integer sum
    below ``2**22``, the integer score is below ``2**30`` (``|k| <= 128``: no int32 overflow at D
    256), and its conversion to float32 is the one rounding. The split kernel then scales it in one
    multiply-add, ``float(score) * s + half_sum * s`` with ``s = step * unit / 254`` (``half_sum *
    s`` rounded once per row); the GPU fuses it into one ``FFMA`` where the interpreter rounds the
    product and the sum apart, so GPU and interpreter scores may differ in their last bit. A row
    with a NaN or infinite query has a NaN or infinite ``half_sum`` (taken from the float terms,
    before their int8 conversion), so its scores are not finite, as with fp16 keys.
    ``INTERLEAVED``: the columns follow the inline PTX's key order, parts 0 and 1 paired for 4-bit
    keys, 0 and 2, 1 and 3 for 3- and 5-bit ones (the quarters one string decodes together).

    Args:
        q0: part 0 of the head dim, ``[G_PAD, PC_PAD]``.
        q1: part 1, the same shape.
        q2: part 2 (``PARTS`` 4), else ignored.
        q3: part 3 (``PARTS`` 4), else ignored.
        PARTS: the keys' parts, 2 (4-bit) or 4 (3- and 5-bit).
        INTERLEAVED: permute the columns for the inline PTX.

    Returns:
        ``(hi0, hi1, hi2, hi3)`` and ``(lo0, lo1, lo2, lo3)`` transposed, ``[PC_PAD, G_PAD]``
        int8 (``PARTS`` 2: parts 2 and 3 repeat part 0); ``half_sum [G_PAD]`` and ``step
        [G_PAD]`` float32.
    """
    tl.static_assert(
        PARTS == 2 or PARTS == 4, "int8 keys have 2 (4-bit) or 4 (3- and 5-bit) parts"
    )
    x0 = q0.to(tl.float32)
    x1 = q1.to(tl.float32)
    largest = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
    if PARTS == 4:
        x2 = q2.to(tl.float32)
        x3 = q3.to(tl.float32)
        largest = tl.maximum(largest, tl.max(tl.abs(x2), axis=1))
        largest = tl.maximum(largest, tl.max(tl.abs(x3), axis=1))
    step, inv_step = _int8_steps(largest)
    inv_step = inv_step[:, None]
    if PARTS == 2:
        hi0, hi1, lo0, lo1, total = _int8_pair(x0 * inv_step, x1 * inv_step, INTERLEAVED)
        hi2 = hi0
        hi3 = hi0
        lo2 = lo0
        lo3 = lo0
    else:
        hi0, hi2, lo0, lo2, total = _int8_pair(x0 * inv_step, x2 * inv_step, INTERLEAVED)
        hi1, hi3, lo1, lo3, total13 = _int8_pair(x1 * inv_step, x3 * inv_step, INTERLEAVED)
        total += total13
    his = (
        tl.trans(hi0.to(tl.int8)),
        tl.trans(hi1.to(tl.int8)),
        tl.trans(hi2.to(tl.int8)),
        tl.trans(hi3.to(tl.int8)),
    )
    los = (
        tl.trans(lo0.to(tl.int8)),
        tl.trans(lo1.to(tl.int8)),
        tl.trans(lo2.to(tl.int8)),
        tl.trans(lo3.to(tl.int8)),
    )
    return his, los, 0.5 * total, step


@triton.jit
def _int8_parts(t, PARTS: tl.constexpr, PC: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The ``PARTS`` parts of whole rows ``t [G_PAD, PARTS * PC]`` (int8), transposed
    ``[PC, G_PAD]``, in :func:`int8_query`'s column order: part ``p`` is columns ``[p * PC, (p +
    1) * PC)``; with ``INTERLEAVED`` the two parts of a pair (0 and 1 for 2 parts, 0 and 2, 1
    and 3 for 4) trade columns as :func:`_int8_pair` arranges them (column ``4g + 2b + h`` of
    the pair's operand ``a`` takes column ``4g + 2a + b`` of the pair's part ``h``). Unused
    parts (``PARTS`` 2) repeat part 0."""
    tl.static_assert(PARTS == 2 or PARTS == 4, "int8 keys have 2 or 4 parts")
    tl.static_assert(PARTS * PC == t.shape[1], "the rows are the parts, unpadded")
    tl.static_assert(not INTERLEAVED or PC % 4 == 0, "the PTX's order takes 4 columns at a time")
    if not INTERLEAVED:
        return _row_parts(t, PARTS, PC)
    G_PAD: tl.constexpr = t.shape[0]
    if PARTS == 2:
        # [G_PAD, h, g, a, b] -> [G_PAD, g, b, h, a]
        pairs = tl.permute(tl.reshape(t, [G_PAD, 2, PC // 4, 2, 2]), [0, 2, 4, 1, 3])
        p0, p1 = tl.split(tl.reshape(pairs, [G_PAD, PC, 2]))
        p0 = tl.trans(p0)
        p1 = tl.trans(p1)
        p2 = p0
        p3 = p0
    else:
        # part 2 * h + k: the pairs are the parts of one k, h their place in the pair;
        # [G_PAD, h, k, g, a, b] -> [G_PAD, g, b, h, k, a]
        pairs = tl.permute(tl.reshape(t, [G_PAD, 2, 2, PC // 4, 2, 2]), [0, 3, 5, 1, 2, 4])
        pairs = tl.reshape(pairs, [G_PAD, PC, 2, 2])
        first, second = tl.split(pairs)  # operand a: [G_PAD, PC, k] each
        p0, p1 = tl.split(first)
        p2, p3 = tl.split(second)
        p0 = tl.trans(p0)
        p1 = tl.trans(p1)
        p2 = tl.trans(p2)
        p3 = tl.trans(p3)
    return p0, p1, p2, p3


@triton.jit
def rotated_int8_query(y, PARTS: tl.constexpr, PC: tl.constexpr, INTERLEAVED: tl.constexpr):
    """:func:`rotated_parts` then :func:`int8_query`, the same bits (but for the int8 terms of a
    row with a NaN or beyond fp16's range: a non-finite value's conversion, left to the compiled
    code; that row's ``half_sum`` and so its scores are not finite either way): the rotated
    queries ``y [G_PAD, PARTS * PC]`` (:func:`rotate_query`) rounded to fp16 and to their int8
    terms whole, then cut into parts. Rounding before
    the cut moves the parts' permutations onto the int8 terms, out of the float chain that
    Triton computes twice, in the layout of the row sums and in the operands' (fewer
    instructions before the split kernel's streaming loop: docs/design/decode.md, "Query mode").
    Returns :func:`int8_query`'s ``(his, los, half_sum, step)``."""
    y = y.to(tl.float16).to(tl.float32)  # rotated_parts' fp16, which int8_query rounds
    step, inv_step = _int8_steps(tl.max(tl.abs(y), axis=1))
    hi, lo = _int8_terms(y * inv_step[:, None])
    half_sum = 0.5 * tl.sum(hi * 254.0 + lo, axis=1)
    his = _int8_parts(hi.to(tl.int8), PARTS, PC, INTERLEAVED)
    los = _int8_parts(lo.to(tl.int8), PARTS, PC, INTERLEAVED)
    return his, los, half_sum, step


@triton.jit
def original_query(
    query, b, q_head, row_ok, D: tl.constexpr, D_PAD: tl.constexpr, F32: tl.constexpr
):
    """The group's original (unrotated, unscaled) queries, transposed: ``[D_PAD, G_PAD]`` in the
    query's dtype (float32 with ``F32``), zero in padded rows and columns; the B operand of a
    ring's ``S^T = K @ Q^T``."""
    q_ptr, stride_qb, stride_qh = query
    d = tl.arange(0, D_PAD)
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + q_head[None, :] * stride_qh + d[:, None]
    q_t = tl.load(q_ptrs, mask=row_ok[None, :] & (d < D)[:, None], other=0.0)
    if F32:
        q_t = q_t.to(tl.float32)
    return q_t


@triton.jit
def ring_query(query, b, q_head, row_ok, D: tl.constexpr, D_PAD: tl.constexpr, F32: tl.constexpr):
    """:func:`original_query` as four quarters of the head dim, ``[D_PAD / 4, G_PAD]`` each:
    the split kernel reads ring keys a quarter at a time to keep their registers down."""
    q_t = original_query(query, b, q_head, row_ok, D, D_PAD, F32)
    G_PAD: tl.constexpr = q_t.shape[1]
    quarters = tl.permute(tl.reshape(q_t, [2, 2, D_PAD // 4, G_PAD]), [2, 3, 1, 0])
    low, high = tl.split(quarters)
    q0, q1 = tl.split(low)
    q2, q3 = tl.split(high)
    return q0, q1, q2, q3
