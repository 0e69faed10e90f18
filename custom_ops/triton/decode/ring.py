"""The recent window's ring as partials of their own, for rotated values (tq4_nc, tq3_nc, tq2_nc).

Formats whose values are in the original space read the ring inside the split kernel
(:mod:`custom_ops.triton.decode.split`). Rotated values accumulate in the code space, where the
ring would have to be rotated into, so for them this kernel (grid ``(window parts, Hk, B)``)
attends over the ring in full precision and in the original space and writes ``window parts``
more partials per row, which the merge adds after rotating the compressed partials back. With
programmatic dependent launch it starts once every split program has, and runs beside the split
kernel's tail instead of after it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from custom_ops.formats import RecentWindow
from custom_ops.triton.decode.query import original_query
from custom_ops.triton.decode.softmax import (
    causal_ends,
    mask_scores,
    partial_normalizer,
    softmax_rescale,
)
from custom_ops.triton.decode.tiles import ring_product, split_probabilities
from custom_ops.triton.paged import ring_arguments, ring_slots, ring_start

__all__ = [
    "BLOCK_W",
    "NUM_WARPS",
    "window_parts",
    "ring_partials_kernel",
    "launch_ring",
]

# Ring slots per tile and warps per program; a window is split over at most MAX_PARTS programs
# per (sequence, kv-head), and the sinks may take one more (window_parts). The sinks are read in
# tiles of SINK_BLOCK places (the tensor cores' M).
BLOCK_W = 64
NUM_WARPS = 4
MAX_PARTS = 8
SINK_BLOCK = 16


def window_parts(
    window: int, sinks: int = 0, sequence_heads: int = 0, sm_count: int | None = None
) -> tuple[int, int]:
    """``(parts, slots_per_part)`` of rings of ``window`` window slots and ``sinks`` sink slots:
    this kernel's programs per (sequence, kv-head), each over whole ``BLOCK_W`` tiles of the
    window's places, the last one also over the sinks; ``(0, 0)`` without a ring.

    Where one part more for each of the ``sequence_heads`` (B x Hk) would still leave each of
    a GPU's ``sm_count`` SMs at most one program (one sequence, few heads), the sinks get that
    part of their own, past the window's places: their tile then runs beside the window's
    instead of after one of them. On fuller grids the extra programs would wait for SMs
    instead, so there (and off a GPU, ``sm_count`` None) the sinks share the window's last part
    (``docs/design/decode.md#sinks-in-the-split-kernel``)."""
    if window == 0:
        return (1 if sinks else 0), 0
    parts = min(MAX_PARTS, triton.cdiv(window, BLOCK_W))
    slots = triton.cdiv(triton.cdiv(window, parts), BLOCK_W) * BLOCK_W
    parts = triton.cdiv(window, slots)
    apart = sinks > 0 and sm_count is not None and (parts + 1) * sequence_heads <= sm_count
    return parts + apart, slots


@triton.jit
def _ring_keys(k_window_ptr, rows, in_tile, D: tl.constexpr, D_PAD: tl.constexpr):
    """``k [N, D_PAD]``: the key rows at ring rows ``rows [N]`` (element offsets), zeros where
    not ``in_tile``."""
    d = tl.arange(0, D_PAD)
    return tl.load(
        k_window_ptr + rows[:, None] + d[None, :],
        mask=in_tile[:, None] & (d < D)[None, :],
        other=0.0,
    )


@triton.jit
def _ring_values(v_window_ptr, rows, in_tile, D: tl.constexpr, D_PAD: tl.constexpr):
    """``v_t [D_PAD, N]``: the value rows at ring rows ``rows [N]``, transposed, zeros where
    not ``in_tile``."""
    d = tl.arange(0, D_PAD)
    return tl.load(
        v_window_ptr + rows[None, :] + d[:, None],
        mask=in_tile[None, :] & (d < D)[:, None],
        other=0.0,
    )


@triton.jit
def _probabilities(
    m_w,
    l_w,
    k,
    in_tile,
    positions,
    query,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """The online softmax's step over a tile of ring places holding ``positions [N]`` with
    keys ``k`` (:func:`_ring_keys`): ``(m, l, alpha, p [N, G_PAD])``, the accumulators to be
    rescaled by ``alpha`` when the values are added (:func:`_add_values`). ``query = (q_orig,
    q_scale, masking, b, q_head, row_ok)``."""
    q_orig, q_scale, masking, b, q_head, row_ok = query
    scores = tl.dot(k.to(q_orig.dtype), q_orig)
    scores = mask_scores(
        scores * q_scale, positions, masking, b, q_head, row_ok, MASK, Q_TOKENS, SOFTCAP
    )
    scores = tl.where(in_tile[:, None], scores, float("-inf"))
    m_w, m_sub, alpha = softmax_rescale(tl.max(scores, axis=0), m_w)
    p = tl.math.exp2(scores - m_sub[None, :])
    return m_w, l_w * alpha + tl.sum(p, axis=0), alpha, p


@triton.jit
def _add_values(acc_w, alpha, p, v_t, WINDOW_F32: tl.constexpr):
    """``O^T [D_PAD, G_PAD]`` rescaled by ``alpha`` plus ``v_t @ p`` (:func:`_probabilities`,
    :func:`_ring_values`)."""
    p_hi, p_lo = split_probabilities(p, v_t.dtype, WINDOW_F32)
    return ring_product(v_t, p_hi, p_lo, acc_w * alpha[None, :], WINDOW_F32)


@triton.jit
def _attend_tile(
    m_w,
    l_w,
    acc_w,
    rows,
    in_tile,
    positions,
    query,
    ring_ptrs,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    WINDOW_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """``(m, l, O^T)`` after one tile of ring places: its keys, the softmax step, then its
    values, loaded after the scores (``ring_ptrs = (k_window_ptr, v_window_ptr)``)."""
    k_window_ptr, v_window_ptr = ring_ptrs
    k = _ring_keys(k_window_ptr, rows, in_tile, D, D_PAD)
    m_w, l_w, alpha, p = _probabilities(
        m_w, l_w, k, in_tile, positions, query, MASK, Q_TOKENS, SOFTCAP
    )
    v_t = _ring_values(v_window_ptr, rows, in_tile, D, D_PAD)
    return m_w, l_w, _add_values(acc_w, alpha, p, v_t, WINDOW_F32)


@triton.jit
def ring_partials_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    q_scale,
    rings,
    window,
    seq_lens_ptr,
    max_len,
    mask_args,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SLOTS_PER_PART: tl.constexpr,
    SINK_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    WINDOW_QK_F32: tl.constexpr,
    WINDOW_F32: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Attention of a GQA group's queries over places ``[part * SLOTS_PER_PART, ..)`` of the
    recent window's run, and in the last part also over the sinks (grid ``(window parts, Hk,
    B)``), stored as the rows' partial ``NUM_SPLITS + part`` (normalized, original space) with
    its lse (log2 domain).

    The window's run is the positions ``first .. len - 1`` (``first`` from the slots'
    positions, :func:`~custom_ops.triton.paged.ring_start`), position ``p`` at slot ``p`` mod
    ``W``; the sinks are the positions below ``min(SINKS, len)`` (slot ``W + p``), read in
    ``SINK_BLOCK``-place tiles. ``S^T = K @ Q^T`` against the original query in the ring's
    dtype (tf32, exact for 16-bit inputs, when the query's dtype differs), ``O^T += V^T @ P^T``
    with the values in the ring's dtype and ``P`` split into two terms of it
    (:func:`~custom_ops.triton.decode.tiles.ring_product`: bf16 values beyond fp16's range stay
    finite), float32 accumulation; all float32 under the interpreter, which cannot run 16-bit
    dots. With PDL it waits for the split kernel at its end, so the merge,
    which waits for this kernel, sees both.
    """
    part = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    k_window_ptr, v_window_ptr, pos_ptr, stride_w_b, stride_w_h, stride_w_slot = rings
    ring = b.to(tl.int64) * stride_w_b + head.to(tl.int64) * stride_w_h
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_len)
    # the window's positions [first, len), position p at slot p mod W (a part past the
    # window's places, the sinks' own, reads no slot positions: first = len)
    first = ring_start(
        pos_ptr + ring // D, seq_len, tl.where(part * SLOTS_PER_PART < window, window, 0)
    )
    place_end = tl.minimum((part + 1) * SLOTS_PER_PART, seq_len - first)
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_head = head * GROUP + g
    q_rows = (b * num_kv_heads * GROUP + q_head).to(tl.int64)
    masking = (mask_args, causal_ends(seq_len, q_head, Q_TOKENS, MASK))
    d = tl.arange(0, D_PAD)
    q_orig = original_query(
        (q_ptr, stride_qb, stride_qh), b, q_head, row_ok, D, D_PAD, WINDOW_QK_F32
    )
    m_w = tl.full([G_PAD], float("-inf"), tl.float32)
    l_w = tl.zeros([G_PAD], tl.float32)
    acc_w = tl.zeros([D_PAD, G_PAD], tl.float32)  # O^T
    query = (q_orig, q_scale, masking, b, q_head, row_ok)
    ring_ptrs = (k_window_ptr, v_window_ptr)
    for r0 in range(part * SLOTS_PER_PART, place_end, BLOCK_W):
        r = r0 + tl.arange(0, BLOCK_W)  # places of the window's run
        positions = first + r
        rows = ring + ring_slots(positions, window, 0).to(tl.int64) * stride_w_slot
        m_w, l_w, acc_w = _attend_tile(
            m_w,
            l_w,
            acc_w,
            rows,
            r < place_end,
            positions,
            query,
            ring_ptrs,
            MASK,
            Q_TOKENS,
            D,
            D_PAD,
            WINDOW_F32,
            SOFTCAP,
        )
    if SINKS > 0:
        # The sinks [0, min(SINKS, len)) at slots W + p, read by the last part: one past the
        # window's places on short grids, the window's last on full ones (window_parts). The
        # other parts skip the loop, and so the products of a tile of masked places.
        num_sinks = tl.where(part == tl.num_programs(0) - 1, tl.minimum(SINKS, seq_len), 0)
        for s0 in range(0, num_sinks, SINK_BLOCK):
            positions = s0 + tl.arange(0, SINK_BLOCK)
            rows = ring + ring_slots(positions, window, SINKS).to(tl.int64) * stride_w_slot
            m_w, l_w, acc_w = _attend_tile(
                m_w,
                l_w,
                acc_w,
                rows,
                positions < num_sinks,
                positions,
                query,
                ring_ptrs,
                MASK,
                Q_TOKENS,
                D,
                D_PAD,
                WINDOW_F32,
                SOFTCAP,
            )
    lse, inv_l = partial_normalizer(m_w, l_w)
    part_rows = q_rows * NUM_PARTIALS + NUM_SPLITS + part
    out_ptrs = part_out_ptr + part_rows[None, :] * D + d[:, None]
    tl.store(out_ptrs, acc_w * inv_l[None, :], mask=row_ok[None, :] & (d < D)[:, None])
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)
    if PDL:
        gdc_wait()  # for the split kernel: the merge waits only for this one


def launch_ring(
    launch,
    q: torch.Tensor,
    q_scale: float,
    window: RecentWindow,
    seq_lens: torch.Tensor,
    capacity: int,
    mask_args: tuple,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    key: Hashable | None = None,
) -> None:
    """Write the ring's partials of ``q [B, Hq * T, D]`` (query rows) over ``window``'s rings
    into ``part_out``/``part_lse`` after the splits' (``launch``: the plan's launch of this
    kernel; ``capacity``: positions a sequence holds; ``mask_args``: ``(mask, stride_b,
    stride_h, stride_t, mask_len)``; ``key``: the launcher's specialization key)."""
    launch(
        q,
        q.stride(0),
        q.stride(1),
        q_scale,
        ring_arguments(window),
        window.size,
        seq_lens,
        capacity,
        mask_args,
        part_out,
        part_lse,
        window.k_window.shape[1],
        key=key,
    )
