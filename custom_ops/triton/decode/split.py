"""The split kernel: attention of a GQA group over one split of a sequence's compressed tokens.

Grid ``(num_splits, Hk, B)``: one program per (sequence, kv-head, split) serves every q-head of
the GQA group, so each cache byte is read once. Each split finds its token range from
``seq_lens`` on the device (an empty split writes a neutral partial), then streams tiles with
the *tokens* as the tensor cores' M dimension (:mod:`custom_ops.triton.decode.tiles`): ``S^T = K
@ Q^T`` and ``O^T += V^T @ P^T``, so the GQA group is only the N = 8 side (padding 4 heads to 8,
not to 16 rows). A program is one warp, so the softmax reduces over tokens inside it and ``P^T``
feeds the next product without leaving it; where the grid leaves SMs idle (short contexts) it
is two warps, each decoding half of a tile. The codecs' scalars are folded in: the key
norm/scale multiplies the scores, the value scale multiplies the probabilities before ``V^T @
P^T`` and the value zero enters through a running ``sum(p * zero)`` (so does the half unit of
3-bit Lloyd-Max values, which streaming splits decode as the grid's integers). Values whose
scales would overflow fp16 in ``p * scale`` (or lose its precision) are redone in units of the
largest scale, so values of any magnitude come out right. Value codes are stored token-minor
(:mod:`custom_ops.formats`), so the A operand ``V^T`` (4 consecutive tokens of one byte column
per register) is one aligned 32-bit load.

With a recent window the splits cover the compressed positions ``[0, len - W)``, the sinks' ones
(below ``SINKS``) masked; for values
in the original space the kernel also reads the ring (``RING``): the tiles of its ring run (the
window's positions, then the sinks) go round robin to the splits, ``RING_BLOCK`` places each,
and enter the same softmax state and accumulators.

A decode step with its own token (``STEP``, ``tq.decode_step``) reads the lengths from the
step's positions: the splits attend the cache as it was, the last split also the step's key
and value, exactly. With ``STEP_APPEND`` one program per sequence-head (``EVICT_SPLIT``: one
more than the splits, or the last split where those would take the grid past one wave)
quantizes the token leaving the ring into its page at once (past every split's compressed
tokens: :func:`custom_ops.triton.store_window.append_rows`' ``EVICT`` phase); the merge, once
every split has read the ring, writes the step's token into it (the ``FILL`` phase).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from custom_ops.formats import PagedKVCache, RecentWindow
from custom_ops.triton.decode.codes import int8_keys, subnormal_part_scale
from custom_ops.triton.decode.query import (
    int8_query,
    query_part,
    ring_query,
    rotate_query,
    rotated_int8_query,
    rotated_parts,
)
from custom_ops.triton.decode.softmax import (
    LANE_ROWS,
    RESCALE_SLACK,
    causal_ends,
    lane_row_sums,
    mask_scores,
    needs_rescale,
    partial_normalizer,
    softmax_rescale,
)
from custom_ops.triton.decode.tiles import (
    compressed_scores,
    compressed_values,
    head_planes,
    ring_scores,
    ring_values,
    table_entries,
    tile_pages,
    tile_scalars,
    value_multipliers,
)
from custom_ops.triton.paged import (
    plane_arguments,
    ring_arguments,
    ring_run_length,
    ring_run_positions,
    ring_slots,
    ring_start,
    table_arguments,
)
from custom_ops.triton.store_window import EVICT, append_rows, narrowed_start, token_arguments
from custom_ops.triton.traced import unread

__all__ = [
    "DecodeStep",
    "split_kernel",
    "split_arguments",
    "launch_split",
    "compile_split",
    "UNIT_MAX",
    "UNIT_MIN",
]


class DecodeStep(NamedTuple):
    """A decode step's own tokens (``tq.decode_step``): ``key``, ``value`` ``[B, Hk, 1, D]``
    (last dim contiguous) at positions ``start_pos [B]`` (int32 or int64); the new lengths
    ``new_lens [B] int32``, which the merge's fill of the ring writes."""

    key: torch.Tensor
    value: torch.Tensor
    start_pos: torch.Tensor
    new_lens: torch.Tensor


# Where the split kernel gets its queries (plan.QueryMode): scaled here (unrotated keys),
# rotated by the preparation kernel, or rotated here (rotated keys at short contexts).
QUERY_SCALED = tl.constexpr(0)
QUERY_PREPARED = tl.constexpr(1)
QUERY_ROTATED_HERE = tl.constexpr(2)
# What the split kernel does with a decode step's own token (plan.StepMode): nothing, or attend
# and append it.
STEP_NONE = tl.constexpr(0)
STEP_APPEND = tl.constexpr(1)


# The largest value scale (or norm) whose products p * v_scale the split pass takes as they are
# (p <= 2**RESCALE_SLACK: the products stay below 2**15, fp16's largest power of two, and below
# 1.75 * 2**15 with the factor of 3-bit values decoded as integers, tiles.compressed_values).
UNIT_MAX = tl.constexpr(2.0 ** (15 - RESCALE_SLACK.value))
UNIT_MIN = tl.constexpr(2.0**-10)


@triton.jit
def _compressed_pass(
    inv_unit,
    tiles,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBTILES: tl.constexpr,
    ONE_TILE: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INT8_KEYS: tl.constexpr,
    SCALARS_AHEAD: tl.constexpr,
    VALUE_PAGES: tl.constexpr,
    SUBNORMAL_VALUES: tl.constexpr,
    SCALAR_PAGES: tl.constexpr,
):
    """The online softmax over the compressed tokens ``[start, end)`` of ``tiles``: ``(m, l,
    acc0..3, zero_acc, v_top)``, the value products accumulated in units of ``1 / inv_unit``
    (``SUBNORMAL_VALUES``: times each part's subnormal unit, ``1 /``
    :func:`~custom_ops.triton.decode.codes.subnormal_part_scale`) and ``v_top`` the largest
    value scale seen. ``SCALARS_AHEAD`` (one tile per step, streaming
    splits): each tile's key and value scalars are loaded during the tile before
    (:func:`~custom_ops.triton.decode.tiles.tile_scalars`); ``VALUE_PAGES``: see
    :func:`~custom_ops.triton.decode.tiles.compressed_values`; ``SCALAR_PAGES``: each tile's
    page ids are read as scalars (:func:`~custom_ops.triton.decode.tiles.tile_pages`).

    ``m`` is the maximum the probabilities are taken against, not always the scores' running
    maximum: it moves (and the accumulators are rescaled) only when a tile's scores rise above
    it by more than ``RESCALE_SLACK``, so probabilities reach ``2**RESCALE_SLACK``; ``l`` and
    the accumulators are relative to it, which is all the partial needs."""
    (
        start,
        end,
        early_a,
        early_b,
        b,
        table,
        k_plane,
        meta_plane,
        v_plane,
        qs,
        masking,
        q_head,
        row_ok,
    ) = tiles
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    m_sub = tl.zeros([G_PAD], tl.float32)  # m_i, 0 where -inf: what exp2 subtracts
    # l and the zero term's sum as each lane's share, [8, G_PAD] (softmax.lane_row_sums),
    # summed over the 8 rows once, after the loop
    l_rows = tl.zeros([LANE_ROWS, G_PAD], tl.float32)
    # O^T = V^T @ P^T per value part: [V_PC_PAD, G_PAD] float32
    V_PC_PAD: tl.constexpr = V.PC_PAD
    acc0 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc1 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc2 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc3 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    zero_rows = tl.zeros([LANE_ROWS, G_PAD], tl.float32)
    v_seen = tl.zeros([BLOCK_N], tl.float32)  # per lane: no cross-lane step in the loop
    # 3-bit Lloyd-Max values as the grid's integers in streaming splits (H200: 5-8% at long
    # contexts); a one-tile split keeps their levels, where the zero term's reduction would
    # lengthen the short chain it waits for
    # (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program)
    INTEGER_VALUES: tl.constexpr = (V.INTEGER_SCALE > 0.0) and (not ONE_TILE)
    # Each iteration streams SUBTILES tiles of BLOCK_N tokens that share one softmax update
    # (running max, rescale of the accumulators), which amortizes its cross-lane reductions
    # while the codes are still decoded BLOCK_N tokens at a time.
    tl.static_assert(not SCALARS_AHEAD or (SUBTILES == 1 and not ONE_TILE))
    if SCALARS_AHEAD:
        k_next, v_next, zero_next = tile_scalars(
            start + tl.arange(0, BLOCK_N), end, b, table, meta_plane, PAGE_SIZE, SINKS, K, V
        )
    for tile_start in range(start, end, SUBTILES * BLOCK_N):
        n_a = tile_start + tl.arange(0, BLOCK_N)
        k_mul_a = None
        v_mul_a = None
        v_zero_a = None
        if SCALARS_AHEAD:
            k_mul_a = k_next
            v_mul_a = v_next
            v_zero_a = zero_next
            k_next, v_next, zero_next = tile_scalars(
                n_a + BLOCK_N, end, b, table, meta_plane, PAGE_SIZE, SINKS, K, V
            )
        pages_a = None
        pages_b = None
        if SCALAR_PAGES:
            pages_a = tile_pages(tile_start, end, b, table, PAGE_SIZE, BLOCK_N)
            if SUBTILES == 2:
                pages_b = tile_pages(tile_start + BLOCK_N, end, b, table, PAGE_SIZE, BLOCK_N)
        scores_a, page_a, slot_a, m_row_a, valid_a = compressed_scores(
            n_a,
            end,
            early_a,
            b,
            table,
            k_plane,
            meta_plane,
            qs,
            masking,
            q_head,
            row_ok,
            MASK,
            Q_TOKENS,
            PAGE_SIZE,
            D,
            K,
            ONE_TILE,
            SINKS,
            SOFTCAP,
            INT8_KEYS,
            k_mul_a,
            pages_a,
        )
        tile_max = scores_a
        if SUBTILES == 2:
            scores_b, page_b, slot_b, m_row_b, valid_b = compressed_scores(
                n_a + BLOCK_N,
                end,
                early_b,
                b,
                table,
                k_plane,
                meta_plane,
                qs,
                masking,
                q_head,
                row_ok,
                MASK,
                Q_TOKENS,
                PAGE_SIZE,
                D,
                K,
                ONE_TILE,
                SINKS,
                SOFTCAP,
                INT8_KEYS,
                None,
                pages_b,
            )
            tile_max = tl.maximum(scores_a, scores_b)
        tile_max = tl.max(tile_max, axis=0)
        if needs_rescale(tile_max, m_i):
            m_i, m_sub, alpha = softmax_rescale(tile_max, m_i)
            l_rows *= alpha[None, :]
            zero_rows *= alpha[None, :]
            acc0 *= alpha[None, :]
            acc1 *= alpha[None, :]
            acc2 *= alpha[None, :]
            acc3 *= alpha[None, :]
        p_a = tl.math.exp2(scores_a - m_sub[None, :])
        p_sum = p_a
        if SUBTILES == 2:
            p_b = tl.math.exp2(scores_b - m_sub[None, :])
            p_sum = p_a + p_b
        l_rows += lane_row_sums(p_sum)
        if v_mul_a is None:
            v_mul_a = value_multipliers(m_row_a, valid_a, V)
        v_seen = tl.maximum(v_seen, v_mul_a)
        acc0, acc1, acc2, acc3, zero_rows = compressed_values(
            p_a,
            v_mul_a,
            inv_unit,
            page_a,
            slot_a,
            m_row_a,
            valid_a,
            acc0,
            acc1,
            acc2,
            acc3,
            zero_rows,
            v_plane,
            PAGE_SIZE,
            TOKEN_RUN,
            D,
            V,
            INTEGER_VALUES,
            v_zero_a,
            VALUE_PAGES,
            SUBNORMAL_VALUES,
            pages_a,
        )
        if SUBTILES == 2:
            v_mul_b = value_multipliers(m_row_b, valid_b, V)
            v_seen = tl.maximum(v_seen, v_mul_b)
            acc0, acc1, acc2, acc3, zero_rows = compressed_values(
                p_b,
                v_mul_b,
                inv_unit,
                page_b,
                slot_b,
                m_row_b,
                valid_b,
                acc0,
                acc1,
                acc2,
                acc3,
                zero_rows,
                v_plane,
                PAGE_SIZE,
                TOKEN_RUN,
                D,
                V,
                INTEGER_VALUES,
                None,
                VALUE_PAGES,
                SUBNORMAL_VALUES,
                pages_b,
            )
    l_i = tl.sum(l_rows, axis=0)
    zero_acc = tl.sum(zero_rows, axis=0)
    return m_i, l_i, acc0, acc1, acc2, acc3, zero_acc, tl.max(v_seen, axis=0)


@triton.jit
def _attend_exact(scores, v_rows, in_tile, state, V: tl.constexpr, F32: tl.constexpr):
    """One tile of exact keys' ``scores [N, G_PAD]`` (log2, masked: -inf) and value rows
    ``v_rows [1, N]`` (ring slots, or the step's own token) into ``state = (m, l, zero_acc,
    acc0..3)``, rescaled every tile."""
    m_i, l_i, zero_acc, acc0, acc1, acc2, acc3 = state
    m_i, m_sub, alpha = softmax_rescale(tl.max(scores, axis=0), m_i)
    p = tl.math.exp2(scores - m_sub[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    zero_acc *= alpha
    acc0, acc1, acc2, acc3 = ring_values(
        p,
        v_rows,
        in_tile,
        acc0 * alpha[None, :],
        acc1 * alpha[None, :],
        acc2 * alpha[None, :],
        acc3 * alpha[None, :],
        V,
        F32,
    )
    return m_i, l_i, zero_acc, acc0, acc1, acc2, acc3


@triton.jit
def split_kernel(
    q_ptr,
    q_orig_ptr,
    stride_qb,
    stride_qh,
    q_scale,
    rot_ptr,
    planes,
    table,
    seq_lens_ptr,
    mask_args,
    window,
    rings,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    max_pages,
    tokens,
    start_pos_ptr,
    stride_start,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    LOG2_D: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBTILES: tl.constexpr,
    SCALARS_AHEAD: tl.constexpr,
    VALUE_PAGES: tl.constexpr,
    SUBNORMAL_VALUES: tl.constexpr,
    SCALAR_PAGES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    ONE_TILE: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    QUERY: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    RING: tl.constexpr,
    RING_BLOCK: tl.constexpr,
    RING_QK_F32: tl.constexpr,
    RING_F32: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
    STEP: tl.constexpr = 0,
    EVICT_SPLIT: tl.constexpr = 0,
    STORE_K: tl.constexpr = None,
    STORE_V: tl.constexpr = None,
):
    split = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    if PDL:
        # Programmatic dependent launch: the kernel after this one (ring or merge) may launch
        # once every program of this one has started; when this kernel was launched that way
        # itself, everything but q_code, which the query preparation writes, was ready before.
        gdc_launch_dependents()
    query = (q_orig_ptr, stride_qb, stride_qh)
    if STEP == STEP_APPEND:
        if split == EVICT_SPLIT:
            # The eviction: the token leaving the ring goes into its page now, beside the
            # splits (no split attends that page slot: it is past their compressed tokens; a
            # tile may load its bytes, which then get zero probability), in a program of its
            # own (EVICT_SPLIT == NUM_SPLITS) or, where those would take the grid past one
            # wave, first in the last split. The merge, after every program of this kernel,
            # writes the step's token into the ring.
            row = b * num_kv_heads + head + tl.zeros([1], tl.int32)
            append_rows(
                row,
                row >= 0,
                tokens,
                rings,
                planes,
                table,
                start_pos_ptr,
                stride_start,
                start_pos_ptr,  # (the lengths: written by the fill)
                rot_ptr,
                start_pos_ptr,  # (no key centres)
                num_kv_heads,
                1,
                1,
                window,
                PAGE_SIZE,
                max_pages,
                D,
                D_PAD,
                INV_SQRT_D,
                1,
                STORE_K,
                STORE_V,
                SINKS,
                False,
                False,
                EVICT,
            )
            if EVICT_SPLIT == NUM_SPLITS:
                return

    # This split's token range of the compressed positions [0, ring start), from the
    # device-side length and ring positions: [start, end) (the sinks' positions masked). The
    # ring run's tokens (from the ring start to the length, and the sinks) are read below
    # (RING) or by the ring kernel.
    k_window_ptr, v_window_ptr, pos_ptr, stride_w_b, stride_w_h, stride_w_slot = rings
    ring = b.to(tl.int64) * stride_w_b + head.to(tl.int64) * stride_w_h
    if STEP != STEP_NONE:
        # A decode step with its own token (tokens [B, Hk, 1, D], at position start): the
        # cache as it was before the step, [0, start), and the token itself, exact.
        step_pos = narrowed_start(tl.load(start_pos_ptr + b * stride_start))
        cached = tl.maximum(step_pos, 0)
    else:
        cached = tl.load(seq_lens_ptr + b)
    seq_len = tl.minimum(cached, max_pages * PAGE_SIZE + window)
    compressed_len = ring_start(pos_ptr + ring // D, seq_len, window)
    tile_tokens: tl.constexpr = SUBTILES * BLOCK_N
    if ONE_TILE:
        # A split of at most one tile sits at a fixed place, so its block-table entries are read
        # here, beside the length and before the query rotation, not after them: one dependent
        # round trip fewer on the path that short contexts wait for.
        start = split * tile_tokens
        capacity = max_pages * PAGE_SIZE
        n_first = start + tl.arange(0, BLOCK_N)
        early_a = table_entries(n_first, n_first < capacity, b, table, PAGE_SIZE)
        early_b = early_a
        if SUBTILES == 2:
            n_second = n_first + BLOCK_N
            early_b = table_entries(n_second, n_second < capacity, b, table, PAGE_SIZE)
        end = tl.minimum(start + tile_tokens, compressed_len)
    else:
        early_a = 0  # entries are read per tile
        early_b = 0
        per_split = tl.cdiv(tl.cdiv(compressed_len, NUM_SPLITS), tile_tokens) * tile_tokens
        start = split * per_split
        end = tl.minimum(start + per_split, compressed_len)

    # The GQA group's prepared queries, transposed: fp16 [K.PC_PAD, G_PAD] per part, the B
    # operands of S^T = K @ Q^T (columns >= GROUP: 0). Tokens are the M dimension of both
    # products, so the group is padded to the tensor cores' N = 8, not to M = 16. Unrotated keys
    # scale the query here (one part: 8 bits); rotated keys read q_code (the preparation
    # kernel) or, at short contexts, rotate it here. Int8 keys take the integer Q K^T's
    # operands instead (rows back on the first axis); rotated here, as whole rows.
    INT8_KEYS: tl.constexpr = int8_keys(K.INT8_UNIT, K.PC_PAD, ONE_TILE)
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_head = head * GROUP + g
    q_rows = (b * num_kv_heads * GROUP + q_head).to(tl.int64)
    if QUERY == QUERY_ROTATED_HERE:
        q_rotated = rotate_query(
            query, rot_ptr, b, q_head, row_ok, q_scale, D, LOG2_D, INV_SQRT_D
        )  # [G_PAD, D]
    if INT8_KEYS and QUERY == QUERY_ROTATED_HERE:
        qs = rotated_int8_query(q_rotated, K.PARTS, K.PC, len(K.ASM_INT8) > 0)
    else:
        if QUERY == QUERY_SCALED:
            q0 = query_part(query, b, q_head, row_ok, q_scale, 0, K.PC, K.PC_PAD)
            q1 = q0
            q2 = q0
            q3 = q0
        elif QUERY == QUERY_ROTATED_HERE:
            q0, q1, q2, q3 = rotated_parts(q_rotated, K.PARTS, K.PC)
        else:
            q_part = q_ptr + q_rows[:, None] * (K.PARTS * K.PC_PAD)
            q_part += tl.arange(0, K.PC_PAD)[None, :]
            if PDL:
                gdc_wait()  # for the preparation kernel's q_code
            q0 = tl.trans(tl.load(q_part, mask=row_ok[:, None], other=0.0))
            q1 = tl.trans(
                tl.load(q_part + K.PC_PAD, mask=row_ok[:, None] & (K.PARTS > 1), other=0.0)
            )
            q2 = tl.trans(
                tl.load(q_part + 2 * K.PC_PAD, mask=row_ok[:, None] & (K.PARTS > 2), other=0.0)
            )
            q3 = tl.trans(
                tl.load(q_part + 3 * K.PC_PAD, mask=row_ok[:, None] & (K.PARTS > 2), other=0.0)
            )
        if INT8_KEYS:
            qs = int8_query(
                tl.trans(q0),
                tl.trans(q1),
                tl.trans(q2),
                tl.trans(q3),
                K.PARTS,
                len(K.ASM_INT8) > 0,
            )
        else:
            qs = (q0, q1, q2, q3)

    k_plane, v_plane, meta_plane = head_planes(planes, head.to(tl.int64))
    masking = (mask_args, causal_ends(seq_len, q_head, Q_TOKENS, MASK))
    tiles = (
        start,
        end,
        early_a,
        early_b,
        b,
        table,
        k_plane,
        meta_plane,
        v_plane,
        qs,
        masking,
        q_head,
        row_ok,
    )
    # The value products' fp16 operands are p * v_scale <= 2**RESCALE_SLACK * v_scale: where
    # the largest scale could overflow fp16 or sit where its rounding is coarse, the pass runs
    # again in units of it (operands <= 2**RESCALE_SLACK). Values of ordinary size take one
    # pass. (A while loop around one copy of the pass kept the registers but lost the loop's
    # speed; the plan caps the registers.)
    m_i, l_i, acc0, acc1, acc2, acc3, zero_acc, v_top = _compressed_pass(
        1.0,
        tiles,
        MASK,
        Q_TOKENS,
        PAGE_SIZE,
        TOKEN_RUN,
        D,
        G_PAD,
        BLOCK_N,
        SUBTILES,
        ONE_TILE,
        K,
        V,
        SINKS,
        SOFTCAP,
        INT8_KEYS,
        SCALARS_AHEAD,
        VALUE_PAGES,
        SUBNORMAL_VALUES,
        SCALAR_PAGES,
    )
    unit = tl.full([], 1.0, tl.float32)
    if ((v_top > UNIT_MAX) | (v_top < UNIT_MIN)) & (v_top > 0):
        unit = v_top
        m_i, l_i, acc0, acc1, acc2, acc3, zero_acc, v_top = _compressed_pass(
            1.0 / unit,
            tiles,
            MASK,
            Q_TOKENS,
            PAGE_SIZE,
            TOKEN_RUN,
            D,
            G_PAD,
            BLOCK_N,
            SUBTILES,
            ONE_TILE,
            K,
            V,
            SINKS,
            SOFTCAP,
            INT8_KEYS,
            SCALARS_AHEAD,
            VALUE_PAGES,
            SUBNORMAL_VALUES,
            SCALAR_PAGES,
        )
    if SUBNORMAL_VALUES:
        # the value parts went into the products as subnormals (codes.decode_tile): back to
        # the codes' integers before the ring's exact values join the accumulators (the power
        # of two first: unit * 2**24 overflows float32 for value scales past 2**104)
        acc0 = acc0 * subnormal_part_scale(V.BITS, 0) * unit
        acc1 = acc1 * subnormal_part_scale(V.BITS, 1) * unit
        acc2 = acc2 * subnormal_part_scale(V.BITS, 2) * unit
        acc3 = acc3 * subnormal_part_scale(V.BITS, 3) * unit
    else:
        acc0 *= unit
        acc1 *= unit
        acc2 *= unit
        acc3 *= unit

    if RING:
        # The ring run's RING_BLOCK-token tiles, round robin over the splits from the last one
        # (which may hold fewer compressed tiles) down: each split takes about (W + SINKS) /
        # NUM_SPLITS more tokens, into the same softmax state and accumulators (values not
        # rotated). The run is positions [compressed_len, len), position p at slot p mod W (a
        # tile's rows may wrap around the ring's end), then the sinks (slots W + p).
        rqs = ring_query(query, b, q_head, row_ok, D, D_PAD, RING_QK_F32)
        run_len = ring_run_length(compressed_len, seq_len, SINKS)
        for r0 in tl.range(
            (NUM_SPLITS - 1 - split) * RING_BLOCK, run_len, NUM_SPLITS * RING_BLOCK, num_stages=2
        ):
            run = r0 + tl.arange(0, RING_BLOCK)
            in_ring = run < run_len
            positions = ring_run_positions(run, compressed_len, seq_len, SINKS)
            rows = ring_slots(positions, window, SINKS) * stride_w_slot
            scores = ring_scores(k_window_ptr + ring + rows[:, None], in_ring, rqs, D) * q_scale
            scores = mask_scores(
                scores, positions, masking, b, q_head, row_ok, MASK, Q_TOKENS, SOFTCAP
            )
            scores = tl.where(in_ring[:, None], scores, float("-inf"))
            m_i, l_i, zero_acc, acc0, acc1, acc2, acc3 = _attend_exact(
                scores,
                v_window_ptr + ring + rows[None, :],
                in_ring,
                (m_i, l_i, zero_acc, acc0, acc1, acc2, acc3),
                V,
                RING_F32,
            )
        if STEP != STEP_NONE:
            if split == NUM_SPLITS - 1:
                # the step's own key and value (row 0 of a ring-sized tile), exact, as a
                # prefill chunk attends its own tokens
                key_ptr, value_ptr, stride_kb, stride_kh, _, _, stride_vb, stride_vh, _, _ = tokens
                r = tl.arange(0, RING_BLOCK)
                own = (r == 0) & (step_pos >= 0)
                b64 = b.to(tl.int64)
                head64 = head.to(tl.int64)
                k_own = key_ptr + b64 * stride_kb + head64 * stride_kh + 0 * r
                scores = ring_scores(k_own[:, None], own, rqs, D) * q_scale
                scores = mask_scores(
                    scores,
                    tl.maximum(step_pos, 0) + 0 * r,
                    masking,
                    b,
                    q_head,
                    row_ok,
                    MASK,
                    Q_TOKENS,
                    SOFTCAP,
                )
                scores = tl.where(own[:, None], scores, float("-inf"))
                v_own = value_ptr + b64 * stride_vb + head64 * stride_vh + 0 * r
                m_i, l_i, zero_acc, acc0, acc1, acc2, acc3 = _attend_exact(
                    scores,
                    v_own[None, :],
                    own,
                    (m_i, l_i, zero_acc, acc0, acc1, acc2, acc3),
                    V,
                    RING_F32,
                )

    # This split's partial, normalized, in natural element order; lse in the log2 domain.
    lse, inv_l = partial_normalizer(m_i, l_i)
    part_rows = q_rows * NUM_PARTIALS + split
    j = tl.arange(0, V.PC_PAD)[:, None]
    out_ptrs = part_out_ptr + part_rows[None, :] * D + j
    ok = row_ok[None, :] & (j < V.PC)
    scale = inv_l[None, :]
    tl.store(out_ptrs, (acc0 + zero_acc[None, :]) * scale, mask=ok)
    if V.PARTS > 1:
        tl.store(out_ptrs + V.PC, (acc1 + zero_acc[None, :]) * scale, mask=ok)
    if V.PARTS > 2:
        tl.store(out_ptrs + 2 * V.PC, (acc2 + zero_acc[None, :]) * scale, mask=ok)
        tl.store(out_ptrs + 3 * V.PC, (acc3 + zero_acc[None, :]) * scale, mask=ok)
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)


def split_arguments(
    q,
    q_code,
    q_scale,
    rotation,
    cache: PagedKVCache,
    block_table,
    seq_lens,
    mask_args,
    window: RecentWindow | None,
    part_out,
    part_lse,
    step: DecodeStep | None = None,
) -> tuple:
    """The split kernel's runtime arguments, in order (``mask_args``: ``(mask, stride_b,
    stride_h, stride_t, mask_len)``). ``window``: the recent window, or None (then
    placeholders, never read, and W = 0). The kernel reads the ring positions for where its
    compressed tokens end, and the rings only where its plan says. ``step``: the decode step's
    own tokens (its plan's ``STEP``), or None (placeholders, never read)."""
    if window is None:
        rings, size = (unread(q), unread(q), unread(seq_lens), 0, 0, 0), 0
    else:
        rings, size = ring_arguments(window), window.size
    if step is None:
        tokens = (unread(q), unread(q), 0, 0, 0, 0, 0, 0, 0, 0)
        step_args = (unread(seq_lens), 0)
    else:
        tokens = token_arguments(step.key, step.value)
        step_args = (step.start_pos, step.start_pos.stride(0))
    return (
        q_code,
        q,
        q.stride(0),
        q.stride(1),
        q_scale,
        rotation,
        plane_arguments(cache),
        table_arguments(block_table),
        seq_lens,
        mask_args,
        size,
        rings,
        part_out,
        part_lse,
        cache.k_codes.shape[1],
        block_table.shape[1],
        tokens,
        *step_args,
    )


def launch_split(launch, arguments: tuple, key: Hashable | None = None) -> None:
    """Launch the split kernel with :func:`split_arguments` (``launch``: the plan's launch;
    ``key``: the launcher's specialization key)."""
    launch(*arguments, key=key)


def compile_split(launch, arguments: tuple, compile_fn):
    """Compile (not launch) the split kernel through ``compile_fn(kernel, grid, *args,
    **kwargs)`` (``benchmarks/sass_report.py`` compiles for sm_90 offline)."""
    return compile_fn(split_kernel, launch.grid, *arguments, **launch.kwargs)
