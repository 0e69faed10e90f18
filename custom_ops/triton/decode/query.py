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
    "query_part",
    "rotate_query",
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
    PARTS: tl.constexpr,
    PC: tl.constexpr,
):
    """The group's queries rotated into the keys' code space, ``(q @ R / sqrt(D)) * q_scale``,
    as ``PARTS`` transposed parts ``[PC, G_PAD]`` fp16 (unused ones repeat part 0), computed
    in the split kernel instead of by the preparation kernel (short contexts, where that launch
    would be on the critical path).

    For a power-of-two D, ``R = diag(s) @ H`` with ``H`` Walsh-Hadamard and ``s = R[:, 0]``, so
    ``q @ R = (q * s) @ H``: a butterfly over each query row
    (:func:`~custom_ops.triton.hadamard.rotate_rows`, float32 adds), and only R's first column
    is read. Parts are contiguous ranges of ``PC``
    outputs, split off the transposed rows.
    """
    q_ptr, stride_qb, stride_qh = query
    d = tl.arange(0, D)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
    x = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    y = rotate_rows(x, rot_ptr, INV_SQRT_D * q_scale, D, LOG2_D)  # [G_PAD, D]
    G_PAD: tl.constexpr = y.shape[0]
    tl.static_assert(PARTS > 1, "rotated keys have 2 (4-bit) or 4 (2-, 3- and 5-bit) parts")
    if PARTS == 2:
        q0, q1 = tl.split(tl.permute(tl.reshape(y, [G_PAD, 2, PC]), [2, 0, 1]))
        q0 = q0.to(tl.float16)
        q1 = q1.to(tl.float16)
        q2 = q0
        q3 = q0
    else:
        halves = tl.permute(tl.reshape(y, [G_PAD, 2, 2, PC]), [3, 0, 1, 2])
        low, high = tl.split(halves)  # part bit 0; [PC, G_PAD, 2] each
        q0, q2 = tl.split(low)
        q1, q3 = tl.split(high)
        q0 = q0.to(tl.float16)
        q1 = q1.to(tl.float16)
        q2 = q2.to(tl.float16)
        q3 = q3.to(tl.float16)
    return q0, q1, q2, q3


@triton.jit
def int8_query(q0, q1, INTERLEAVED: tl.constexpr):
    """The two halves of a group's prepared queries (``q0, q1 [G_PAD, PC_PAD]``, rows: the
    group's queries) as int8 operands of an exact integer ``Q K^T`` with int8 keys
    (:func:`~custom_ops.triton.decode.codes.decode_int8_keys`).

    Each row is ``(254 hi + lo) * step / 254``: ``step = 2**(E - 5)`` for its largest magnitude
    in ``[2**E, 2**(E + 1))``, ``hi`` the rounded multiples of ``step`` (within -64..64) and
    ``lo`` the rounded remainder in units of ``step / 254`` (within -127..127), so a query is
    kept to ``step / 508``, at most 1/16256 of its largest magnitude: finer than its fp16
    rounding. Against keys at levels ``(k + 1/2) * unit``, a score is ``(254 sum(hi k) + sum(lo
    k) + half_sum) * step * unit / 254`` with ``half_sum = sum(254 hi + lo) / 2``.

    Every step but one is exact, and that one rounds the same way everywhere, so the
    inline-PTX and plain-Triton paths give the same bits: ``step`` is a power of two (made from
    the exponent bits; a division would round differently on the GPU and under the
    interpreter), the fp16 queries times ``1 / step`` keep 11 significant bits, so ``(x - hi) *
    254`` is exact; ``half_sum`` is an integer sum below ``2**22``, the integer score is below
    ``2**30`` (no int32 overflow at D 256), and its conversion to float32 is the one rounding.
    A row with a NaN or infinite query has a NaN or infinite ``half_sum`` (taken from the float
    terms, before their int8 conversion), so its scores are not finite, as with fp16 keys.
    ``INTERLEAVED``: the columns follow the inline PTX's key order (nibbles of bytes ``j, j +
    1`` low, high, low, high).

    Args:
        q0: the low half of the head dim (the keys' low nibbles), ``[G_PAD, PC_PAD]``.
        q1: the high half, the same shape.
        INTERLEAVED: permute the columns for the inline PTX.

    Returns:
        ``(hi0, hi1, lo0, lo1)`` transposed, ``[PC_PAD, G_PAD]`` int8; ``half_sum [G_PAD]`` and
        ``step [G_PAD]`` float32.
    """
    x0 = q0.to(tl.float32)
    x1 = q1.to(tl.float32)
    largest = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
    # the biased exponent of the largest magnitude, at least 6 (zero rows: step 2**-126)
    biased = tl.maximum((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF, 6)
    step = ((biased - 5) << 23).to(tl.float32, bitcast=True)
    inv_step = ((259 - biased) << 23).to(tl.float32, bitcast=True)
    x0 = x0 * inv_step[:, None]
    x1 = x1 * inv_step[:, None]
    if INTERLEAVED:
        # column 4g + 2b + h of operand a takes column 4g + 2a + b of half h
        G_PAD: tl.constexpr = x0.shape[0]
        PC_PAD: tl.constexpr = x0.shape[1]
        halves = tl.join(
            tl.reshape(x0, [G_PAD, PC_PAD // 4, 2, 2]), tl.reshape(x1, [G_PAD, PC_PAD // 4, 2, 2])
        )  # [G_PAD, g, a, b, h]
        x0, x1 = tl.split(tl.reshape(tl.permute(halves, [0, 1, 3, 4, 2]), [G_PAD, PC_PAD, 2]))
    hi0 = tl.floor(x0 + 0.5)
    hi1 = tl.floor(x1 + 0.5)
    lo0 = tl.floor((x0 - hi0) * 254.0 + 0.5)
    lo1 = tl.floor((x1 - hi1) * 254.0 + 0.5)
    half_sum = 0.5 * (tl.sum(hi0 * 254.0 + lo0, axis=1) + tl.sum(hi1 * 254.0 + lo1, axis=1))
    return (
        tl.trans(hi0.to(tl.int8)),
        tl.trans(hi1.to(tl.int8)),
        tl.trans(lo0.to(tl.int8)),
        tl.trans(lo1.to(tl.int8)),
        half_sum,
        step,
    )


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
