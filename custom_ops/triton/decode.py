"""Split-KV decode attention over a compressed paged cache: ``torch.ops.tq.decode`` on CUDA.

Three launches (four with a recent window that the split kernel does not read itself, below),
shapes fixed by the inputs (CUDA-graph safe, no host sync):

1. ``_prep_query_kernel`` (grid ``B * Hq / 16``; rotated keys at long contexts only): rotates
   the query into the keys' code space (``q @ R / sqrt(D)`` for Lloyd-Max keys, 16 rows per
   tensor-core product), multiplies by ``scale * log2(e)`` so the softmax can use ``exp2``,
   and writes it as fp16 in the keys' *parts* (below). Where a split holds few tokens, the
   split kernel rotates its group's queries itself (Walsh-Hadamard structure of R), since this
   launch would then sit on the critical path.
2. ``_split_kernel`` (grid ``(num_splits, Hk, B)``): one program per (sequence, kv-head,
   split) serves every q-head of the GQA group, so each cache byte is read once. Each split
   finds its token range from ``seq_lens`` on the device (an empty split writes a neutral
   partial), then streams ``BLOCK_N``-token tiles with the *tokens* as the tensor cores' M
   dimension: ``S^T = K @ Q^T`` and ``O^T += V^T @ P^T``, so the GQA group is only the N = 8
   side (padding 4 heads to 8, not to 16 rows). A program is one warp, so the softmax reduces
   over tokens inside it and ``P^T`` feeds the next product without leaving it; where the grid
   leaves SMs idle (short contexts) it is two warps, each decoding half of a tile. The codecs'
   scalars are folded in: the key norm/scale multiplies the scores, the value scale multiplies
   the probabilities before ``V^T @ P^T`` and the value zero enters through a running
   ``sum(p * zero)``. Value codes are stored token-minor (:mod:`custom_ops.formats`), so the
   A operand ``V^T`` (4 consecutive tokens of one byte column per register) is one aligned
   32-bit load.
3. ``_merge_kernel`` (grid ``B * Hq / BLOCK_M``): log-sum-exp merge of the splits; rotates
   Lloyd-Max values back to the original space (a Walsh-Hadamard butterfly for power-of-two
   head dims, a product with R otherwise) and casts to the query's dtype.

Recent window: with a full-precision ring of the last ``W`` tokens (``k_window``/``v_window``),
the splits cover the compressed positions ``[0, len - W)``. For values in the original space
(:func:`_ring_in_split`: every format but tq4_nc), the split kernel also reads the ring: its
16-slot tiles go round robin to the splits and enter the same softmax state and accumulators
(in the original space, like those values), so the ring's bytes stream beside the compressed
ones. For rotated values a fourth kernel, ``_window_kernel`` (grid ``(window parts, Hk, B)``),
attends over the ring in full precision and in the original space, writing ``window parts``
more partials per row, which the merge adds after rotating the compressed partials back; with
programmatic dependent launch it starts once every split program has, and runs beside the
split kernel's tail instead of after it.

Parts: the bit planes of :mod:`custom_ops.formats` are strided, so shifting a row of code bytes
yields a *contiguous part* of the head dim: 4-bit codes give two halves (low / high nibbles),
3- and 2-bit codes four quarters, 8-bit codes one part. Each part is decoded straight into its
own ``tl.dot`` operand and multiplied with the matching part of the query: nothing is shuffled. On
the GPU the parts are decoded by inline PTX (:mod:`custom_ops.triton.decode_asm`); under the
interpreter, which cannot run PTX, the same kernel decodes with plain Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from custom_ops.formats import Kind, KVFormat, PagedKVCache
from custom_ops.triton.decode_asm import decode_asm, parts_of
from custom_ops.triton.store import codec_constexprs, first_meta_column

_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
_FP8 = tl.constexpr(int(Kind.FP8))
_INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))
# Where the split kernel gets its queries: scaled there (unrotated keys), rotated by the
# preparation kernel, or rotated there (rotated keys at short contexts; see _query_mode).
_QUERY_SCALED = tl.constexpr(0)
_QUERY_PREPARED = tl.constexpr(1)
_QUERY_ROTATED_HERE = tl.constexpr(2)
LOG2E = 1.4426950408889634
LOG2E_ = tl.constexpr(LOG2E)
# Recent window: ring slots per tile, and warps per program, of the window kernel, which splits
# a ring over at most _MAX_WINDOW_PARTS programs per (sequence, kv-head).
_BLOCK_W = 64
_WINDOW_WARPS = 4
_MAX_WINDOW_PARTS = 8
# Ring tokens per tile when the split kernel reads the window itself (_ring_in_split): 16 keeps
# the ring loop's two pipeline stages within the compressed loop's shared memory class.
_RING_BLOCK = 16
# Merge: warps per program, and the most partial elements per lane for a one-warp program
# (148 registers at D = 128 and 32 splits, offline SASS; 64 splits spill).
_MERGE_WARPS = 4
_MERGE_LANE_FLOATS = 128
# query rows and prepared columns per program of the query preparation
_PREP_ROWS = 16
_PREP_COLUMNS = 16
# Split-kernel defaults (benchmarks/NOTES.md has the sweep): one warp per program keeps the
# softmax reductions and the P^T operand inside a warp.
DEFAULT_BLOCK_N = 32
DEFAULT_WARPS = 1
DEFAULT_STAGES = 2
DEFAULT_SUBTILES = 1


# Formats whose split kernel takes two 16-token tiles per softmax step instead of one of 32
# tokens (H100, NOTES.md "Decode v4" and "Decode v9"): int8 and fp8 always (8-bit keys and
# values decode to one full-width part each, so half the registers are live per tile); k8v4,
# k3v4_nc and k2v4_nc where splits hold several tiles. The kernel waits on loads, and two
# independent tiles keep more of them in flight: those three are 5-8%, 1-3% and 5-6% faster at
# long contexts while executing 15-21% more instructions; at 1 x 1024 (one tile per split)
# k8v4 was 0.5 us slower. 4bit_nc, 3bit_nc and k2v2_nc would need more than 128 registers
# (129-168, offline SASS) and were about 25% slower, tq4_nc 0-4%.
_SUBTILED_FORMATS = ("int8", "fp8")
_SUBTILED_LONG_FORMATS = ("k8v4", "k3v4_nc", "k2v4_nc")


def tile_config(fmt: KVFormat, one_tile: bool = False) -> tuple[int, int]:
    """``(block_n, subtiles)`` of the split kernel for a format, where splits hold at most one
    tile (``one_tile``: short contexts) or more: 16-token tiles two per softmax step for
    :data:`_SUBTILED_FORMATS` (and :data:`_SUBTILED_LONG_FORMATS` in long splits), 32-token
    tiles one per step otherwise. Both read 32 tokens per step."""
    if fmt.name in _SUBTILED_FORMATS or (fmt.name in _SUBTILED_LONG_FORMATS and not one_tile):
        return 16, 2
    return DEFAULT_BLOCK_N, DEFAULT_SUBTILES


@triton.jit
def _prep_query_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    rot_ptr,
    out_ptr,
    num_rows,
    num_q_heads,
    q_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PARTS: tl.constexpr,
    PC: tl.constexpr,
    PC_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[r, c] = (q[r] @ R / sqrt(D))[p * PC + j] * q_scale`` as fp16, ``c = p * PC_PAD + j``,
    for the ``BLOCK_Q`` query rows ``r = b * Hq + h`` and ``BLOCK_C`` columns of this program: a
    ``[BLOCK_Q, D] @ [D, BLOCK_C]`` product on the tensor cores (tf32 is exact here: 16-bit
    queries times +-1), so R is read once per 16 rows, by several programs at once."""
    if PDL:
        gdc_launch_dependents()  # the split kernel may launch now; it waits for q_code
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < num_rows
    q_rows = q_ptr + (rows // num_q_heads).to(tl.int64) * stride_qb
    q_rows += (rows % num_q_heads) * stride_qh
    d = tl.arange(0, D_PAD)
    q_mask = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    elem = (c // PC_PAD) * PC + c % PC_PAD
    ok = (c % PC_PAD) < PC
    rot = tl.load(rot_ptr + d[:, None] * D + elem[None, :], mask=(d[:, None] < D) & ok[None, :],
                  other=0.0)  # fmt: skip
    q_code = tl.dot(q, rot, input_precision="tf32") * INV_SQRT_D
    q_code = tl.where(ok[None, :], q_code * q_scale, 0.0)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * (PARTS * PC_PAD) + c[None, :]
    tl.store(out_ptrs, q_code.to(tl.float16), mask=row_ok[:, None])


@triton.jit
def _values(codes, levels_ptr, KIND: tl.constexpr):
    """Codes -> fp16 values before the per-token scalars (Lloyd-Max levels or integers)."""
    if KIND == _LLOYD_MAX:
        return tl.load(levels_ptr + codes.to(tl.int32)).to(tl.float16)
    return codes.to(tl.float16)


@triton.jit
def _decode_tile(
    codes_ptr,
    row_offsets,
    j,
    mask,
    levels_ptr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    D: tl.constexpr,
    OFF1: tl.constexpr,
    BYTE_STRIDE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    ASM: tl.constexpr,
    FINITE: tl.constexpr = False,
):
    """Decode a tile of code rows into up to four parts (fp16, the tile's shape, *before* the
    per-token scalars; unused parts repeat part 0).

    ``row_offsets`` (offsets of byte 0 of each token's row) and ``j`` (byte of a plane part)
    broadcast to the tile: ``[N, 1]`` and ``[1, PC]`` for keys (token-major, ``BYTE_STRIDE`` 1),
    ``[1, N]`` and ``[PC, 1]`` for values (token-minor, ``BYTE_STRIDE = page_size``), whose
    tokens come in runs of ``TOKEN_RUN`` adjacent bytes (page-aligned; 1: no hint). The inline
    asm packs 4 consecutive bytes of the tile's last axis: 4 elements of a key, or one byte
    column of 4 tokens of values. ``FINITE`` maps the fp8 NaN codes to finite numbers.
    """
    offsets = row_offsets + j * BYTE_STRIDE
    if TOKEN_RUN > 1:
        offsets = tl.max_contiguous(tl.multiple_of(offsets, [1, TOKEN_RUN]), [1, TOKEN_RUN])
    plane = tl.load(codes_ptr + offsets, mask=mask, other=0)
    if BITS == 4:
        # byte j: element j in the low nibble, element j + D/2 in the high nibble
        if ASM != "":
            p0, p1 = tl.inline_asm_elementwise(
                ASM, "=r,=r,=r,=r,r", [plane], dtype=(tl.float16,) * 2, is_pure=True, pack=4
            )
        else:
            p0 = _values(plane & 15, levels_ptr, KIND)
            p1 = _values(plane >> 4, levels_ptr, KIND)
        p2 = p0
        p3 = p0
    elif BITS == 3:
        # 2-bit plane byte j holds element j + q*D/4 at bits 2q; the 1-bit plane's byte j' holds
        # element j' + r*D/8 at bit r, re-read here as a sign tile whose byte j is the 1-bit
        # plane's byte j mod D/8: element j + q*D/4's top bit is its bit 2q + j // (D/8).
        D8: tl.constexpr = D // 8
        sign_offsets = row_offsets + (OFF1 + j % D8) * BYTE_STRIDE
        if TOKEN_RUN > 1:
            sign_offsets = tl.max_contiguous(
                tl.multiple_of(sign_offsets, [1, TOKEN_RUN]), [1, TOKEN_RUN]
            )
        signs = tl.load(codes_ptr + sign_offsets, mask=mask, other=0)
        sign_shift = tl.broadcast_to((j // D8).to(tl.uint8), plane.shape)
        # The asm shifts 4 packed bytes at once: along the tokens (values) they share j, along
        # j (keys) they do when D/8 is a multiple of 4 (not at D = 80: shift here instead).
        if (ASM == "") | ((BYTE_STRIDE == 1) & (D8 % 4 != 0)):
            signs = (signs >> sign_shift).to(tl.uint8)
            sign_shift = tl.zeros_like(sign_shift)
        if ASM != "":
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                ASM,
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                [plane, signs, sign_shift],
                dtype=(tl.float16,) * 4,
                is_pure=True,
                pack=4,
            )
        else:
            p0 = _values((plane & 3) | ((signs & 1) << 2), levels_ptr, KIND)
            p1 = _values(((plane >> 2) & 3) | (signs & 4), levels_ptr, KIND)
            p2 = _values(((plane >> 4) & 3) | ((signs >> 2) & 4), levels_ptr, KIND)
            p3 = _values(((plane >> 6) & 3) | ((signs >> 4) & 4), levels_ptr, KIND)
    elif BITS == 2:
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
            p0 = _values(plane & 3, levels_ptr, KIND)
            p1 = _values((plane >> 2) & 3, levels_ptr, KIND)
            p2 = _values((plane >> 4) & 3, levels_ptr, KIND)
            p3 = _values(plane >> 6, levels_ptr, KIND)
    else:
        if ASM != "":
            p0 = tl.inline_asm_elementwise(
                ASM, "=r,=r,r", [plane], dtype=tl.float16, is_pure=True, pack=4
            )
        elif KIND == _INT8_ABSMAX:
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


@triton.jit
def _mask_scores(
    scores,
    positions,
    mask_ptr,
    b,
    q_head,
    row_ok,
    stride_mask_b,
    stride_mask_h,
    mask_len,
    MASK: tl.constexpr,
):
    """Apply the attention mask at key ``positions [N]`` to ``scores [N, G_PAD]`` (log2 units):
    ``MASK`` 0 none, 1 boolean (False masks out), 2 additive (natural-log units)."""
    if MASK != 0:
        mask_ptrs = mask_ptr + b * stride_mask_b + q_head[None, :] * stride_mask_h
        mask_ptrs += positions[:, None]
        in_mask = row_ok[None, :] & (positions < mask_len)[:, None]
        if MASK == 1:
            allowed = tl.load(mask_ptrs, mask=in_mask, other=0) != 0
            scores = tl.where(allowed, scores, float("-inf"))
        else:
            bias = tl.load(mask_ptrs, mask=in_mask, other=float("-inf")).to(tl.float32)
            scores = scores + bias * LOG2E_
    return scores


@triton.jit
def _softmax_rescale(tile_max, m_i):
    """Online-softmax step in the log2 domain for a tile whose per-query max is ``tile_max
    [G_PAD]``: ``(m_new, m_sub, alpha)``, with ``p = exp2(scores - m_sub)`` and the running sums
    rescaled by ``alpha``. A query masked out so far keeps ``m = -inf``, so 0 is subtracted
    instead."""
    m_new = tl.maximum(m_i, tile_max)
    m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
    return m_new, m_sub, tl.math.exp2(m_i - m_sub)


@triton.jit
def _table_entries(n, ok, b, block_table_ptr, stride_bt_b, stride_bt_p, PAGE_SIZE: tl.constexpr):
    """The block-table entries (int32 page ids) of positions ``n [BLOCK_N]``, read where
    ``ok`` (0 elsewhere)."""
    page_ptr = block_table_ptr + b * stride_bt_b + (n // PAGE_SIZE) * stride_bt_p
    return tl.load(page_ptr, mask=ok, other=0)


@triton.jit
def _key_scores(
    n,
    end,
    table,
    b,
    k_codes_ptr,
    k_head,
    stride_kc_page,
    stride_kc_slot,
    meta_ptr,
    m_head,
    stride_m_page,
    stride_m_slot,
    levels_ptr,
    q0,
    q1,
    q2,
    q3,
    mask_ptr,
    q_head,
    row_ok,
    stride_mask_b,
    stride_mask_h,
    mask_len,
    MASK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_META: tl.constexpr,
    K_OFF1: tl.constexpr,
    K_PARTS: tl.constexpr,
    K_PC: tl.constexpr,
    K_PC_PAD: tl.constexpr,
    K_ASM: tl.constexpr,
):
    """Scores ``S^T = K @ Q^T`` of the tokens at positions ``n [BLOCK_N]`` (``-inf`` at and past
    ``end``) whose block-table entries are ``table`` (:func:`_table_entries`, 0 at and past
    ``end``): ``(scores [BLOCK_N, G_PAD] float32 in log2 units, page, slot, meta row pointers,
    valid)``."""
    valid = n < end
    page = table.to(tl.int64)
    slot = (n % PAGE_SIZE).to(tl.int64)
    # Code rows are read unmasked, so that the loads stay vectorized along the tokens: tokens
    # past the end read their page (or page 0) and get zero probability (see _value_update).
    k_byte = tl.arange(0, K_PC_PAD)[None, :]
    k0, k1, k2, k3 = _decode_tile(
        k_codes_ptr, (page * stride_kc_page + k_head + slot * stride_kc_slot)[:, None], k_byte,
        k_byte < K_PC, levels_ptr, K_KIND, K_BITS, D, K_OFF1, 1, 1, K_ASM,
    )  # fmt: skip
    scores = tl.dot(k0, q0)
    if K_PARTS > 1:
        scores = tl.dot(k1, q1, scores)
    if K_PARTS > 2:
        scores = tl.dot(k2, q2, scores)
        scores = tl.dot(k3, q3, scores)
    m_row = meta_ptr + page * stride_m_page + m_head + slot * stride_m_slot
    if K_KIND != _FP8:
        k_mul = tl.load(m_row + K_META, mask=valid, other=0.0).to(tl.float32)
        scores = scores * k_mul[:, None]
    scores = _mask_scores(scores, n, mask_ptr, b, q_head, row_ok, stride_mask_b, stride_mask_h,
                          mask_len, MASK)  # fmt: skip
    return tl.where(valid[:, None], scores, float("-inf")), page, slot, m_row, valid


@triton.jit
def _value_update(
    p,
    page,
    slot,
    m_row,
    valid,
    acc0,
    acc1,
    acc2,
    acc3,
    zero_acc,
    v_codes_ptr,
    v_head,
    stride_vc_page,
    levels_ptr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_META: tl.constexpr,
    V_OFF1: tl.constexpr,
    V_PARTS: tl.constexpr,
    V_PC: tl.constexpr,
    V_PC_PAD: tl.constexpr,
    V_ASM: tl.constexpr,
):
    """Add one tile's ``O^T += V^T @ (p * v_scale)^T`` per value part (``p [BLOCK_N, G_PAD]``),
    and ``sum(p * v_zero)`` to ``zero_acc`` for uniform values.

    Value codes of tokens past the end enter the product with zero probability, which is only
    safe for codes that decode to finite numbers: fp8 bytes there (stale or never written) can
    be NaN, so fp8 values are decoded ``FINITE``.
    """
    v_byte = tl.arange(0, V_PC_PAD)[:, None]
    v0, v1, v2, v3 = _decode_tile(
        v_codes_ptr, (page * stride_vc_page + v_head + slot)[None, :], v_byte, v_byte < V_PC,
        levels_ptr, V_KIND, V_BITS, D, V_OFF1, PAGE_SIZE, TOKEN_RUN, V_ASM, FINITE=True,
    )  # fmt: skip
    v_mul = tl.load(m_row + V_META, mask=valid, other=0.0).to(tl.float32)
    if V_KIND == _UNIFORM:
        v_zero = tl.load(m_row + V_META + 1, mask=valid, other=0.0).to(tl.float32)
        zero_acc += tl.sum(p * v_zero[:, None], axis=0)
    pv = (p * v_mul[:, None]).to(tl.float16)
    acc0 = tl.dot(v0, pv, acc0)
    if V_PARTS > 1:
        acc1 = tl.dot(v1, pv, acc1)
    if V_PARTS > 2:
        acc2 = tl.dot(v2, pv, acc2)
        acc3 = tl.dot(v3, pv, acc3)
    return acc0, acc1, acc2, acc3, zero_acc


@triton.jit
def _original_query(q_orig_ptr, stride_qb, stride_qh, b, q_head, row_ok, D: tl.constexpr,
                    D_PAD: tl.constexpr, F32: tl.constexpr):  # fmt: skip
    """The group's original (unrotated, unscaled) queries, transposed: ``[D_PAD, G_PAD]`` in the
    query's dtype (float32 with ``F32``), zero in padded rows and columns; the B operand of a
    ring's ``S^T = K @ Q^T``."""
    d = tl.arange(0, D_PAD)
    q_ptrs = q_orig_ptr + b.to(tl.int64) * stride_qb + q_head[None, :] * stride_qh + d[:, None]
    q_t = tl.load(q_ptrs, mask=row_ok[None, :] & (d < D)[:, None], other=0.0)
    if F32:
        q_t = q_t.to(tl.float32)
    return q_t


@triton.jit
def _ring_query(q_orig_ptr, stride_qb, stride_qh, b, q_head, row_ok, D: tl.constexpr,
                D_PAD: tl.constexpr, F32: tl.constexpr):  # fmt: skip
    """:func:`_original_query` as four quarters of the head dim, ``[D_PAD / 4, G_PAD]`` each:
    the split kernel reads ring keys a quarter at a time to keep their registers down."""
    q_t = _original_query(q_orig_ptr, stride_qb, stride_qh, b, q_head, row_ok, D, D_PAD, F32)
    G_PAD: tl.constexpr = q_t.shape[1]
    quarters = tl.permute(tl.reshape(q_t, [2, 2, D_PAD // 4, G_PAD]), [2, 3, 1, 0])
    low, high = tl.split(quarters)
    q0, q1 = tl.split(low)
    q2, q3 = tl.split(high)
    return q0, q1, q2, q3


@triton.jit
def _ring_key_scores(k_rows, in_ring, q0, q1, q2, q3, D: tl.constexpr):
    """``S^T = K @ Q^T`` of ring keys whose rows start at ``k_rows [RING_BLOCK, 1]`` (rows not
    ``in_ring`` read as zeros), a quarter of the head dim at a time (:func:`_ring_query`)."""
    QC: tl.constexpr = q0.shape[0]
    j = tl.arange(0, QC)[None, :]
    k = tl.load(k_rows + j, mask=in_ring[:, None] & (j < D), other=0.0)
    scores = tl.dot(k.to(q0.dtype), q0)
    k = tl.load(k_rows + QC + j, mask=in_ring[:, None] & (j + QC < D), other=0.0)
    scores = tl.dot(k.to(q1.dtype), q1, scores)
    k = tl.load(k_rows + 2 * QC + j, mask=in_ring[:, None] & (j + 2 * QC < D), other=0.0)
    scores = tl.dot(k.to(q2.dtype), q2, scores)
    k = tl.load(k_rows + 3 * QC + j, mask=in_ring[:, None] & (j + 3 * QC < D), other=0.0)
    return tl.dot(k.to(q3.dtype), q3, scores)


@triton.jit
def _ring_values(
    p,
    v_rows,
    in_ring,
    acc0,
    acc1,
    acc2,
    acc3,
    V_PARTS: tl.constexpr,
    V_PC: tl.constexpr,
    V_PC_PAD: tl.constexpr,
    F32: tl.constexpr,
):
    """``O^T += V^T @ P^T`` for ring values (original space) whose rows start at ``v_rows [1,
    RING_BLOCK]``, per value part of the compressed codes (part ``i``: elements ``[i * V_PC,
    (i + 1) * V_PC)``); float32 with ``F32``.

    On the tensor cores the ring's 16-bit values enter as they are (converting bf16 to fp16 cost
    about 70 of the ring loop's 416 instructions), against ``P^T`` split into two terms of the
    ring's dtype, ``p = hi + lo`` to ``2^-16`` relative for bf16: as exact as fp16
    probabilities, for twice the (few) products."""
    j = tl.arange(0, V_PC_PAD)[:, None]
    ok = in_ring[None, :] & (j < V_PC)
    if F32:
        p_hi = p
        p_lo = p
    else:
        p_hi = p.to(v_rows.dtype.element_ty)
        p_lo = (p - p_hi.to(tl.float32)).to(v_rows.dtype.element_ty)
    acc0 = _ring_part(tl.load(v_rows + j, mask=ok, other=0.0), p_hi, p_lo, acc0, F32)
    if V_PARTS > 1:
        acc1 = _ring_part(tl.load(v_rows + V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc1, F32)
    if V_PARTS > 2:
        acc2 = _ring_part(tl.load(v_rows + 2 * V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc2,
                          F32)  # fmt: skip
        acc3 = _ring_part(tl.load(v_rows + 3 * V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc3,
                          F32)  # fmt: skip
    return acc0, acc1, acc2, acc3


@triton.jit
def _ring_part(v_t, p_hi, p_lo, acc, F32: tl.constexpr):
    """``acc + v_t @ (p_hi + p_lo)`` for a ring value part ``v_t [V_PC_PAD, RING_BLOCK]``
    (:func:`_ring_values`): one float32 product with ``F32`` (``p_lo`` is ``p_hi`` there)."""
    if F32:
        return tl.dot(v_t.to(tl.float32), p_hi, acc)
    return tl.dot(v_t, p_lo, tl.dot(v_t, p_hi, acc))


@triton.jit
def _partial_normalizer(m_i, l_i):
    """``(lse, 1 / l)`` of a finished partial; ``lse = -inf`` (and ``1 / l = 1``) if it saw no
    key."""
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.math.log2(safe_l), float("-inf"))
    return lse, 1.0 / safe_l


@triton.jit
def _window_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    q_scale,
    k_window_ptr,
    v_window_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    window,
    seq_lens_ptr,
    max_len,
    mask_ptr,
    stride_mask_b,
    stride_mask_h,
    mask_len,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    MASK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SLOTS_PER_PART: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    WINDOW_QK_F32: tl.constexpr,
    WINDOW_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """Attention of a GQA group's queries over ring slots ``[part * SLOTS_PER_PART, ..)`` of
    the recent window (grid ``(window parts, Hk, B)``), stored as the rows' partial
    ``NUM_SPLITS + part`` (normalized, original space) with its lse (log2 domain).

    The ring holds a sequence's last ``window_len = min(len, W)`` positions, from ``first =
    len - window_len``; slot ``r`` holds the one that is ``r`` mod ``W``. ``S^T = K @ Q^T``
    against the original query in the ring's dtype (tf32, exact for 16-bit inputs, when the
    query's dtype differs), ``O^T += V^T @ P^T`` in fp16 like the compressed tiles, float32
    accumulation; all float32 under the interpreter, which cannot run 16-bit dots.

    With programmatic dependent launch this kernel starts once every program of the split
    kernel before it has started, and runs beside that kernel's tail; it waits for the split
    kernel at its end, so the merge, which waits for this kernel, sees both.
    """
    part = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_len)
    window_len = tl.minimum(seq_len, window)
    first = seq_len - window_len
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_head = head * GROUP + g
    q_rows = (b * num_kv_heads * GROUP + q_head).to(tl.int64)
    d = tl.arange(0, D_PAD)
    q_orig = _original_query(q_ptr, stride_qb, stride_qh, b, q_head, row_ok, D, D_PAD,
                             WINDOW_QK_F32)  # fmt: skip
    ring = b.to(tl.int64) * stride_w_b + head.to(tl.int64) * stride_w_h
    m_w = tl.full([G_PAD], float("-inf"), tl.float32)
    l_w = tl.zeros([G_PAD], tl.float32)
    acc_w = tl.zeros([D_PAD, G_PAD], tl.float32)  # O^T
    slot_end = tl.minimum((part + 1) * SLOTS_PER_PART, window_len)
    for r0 in range(part * SLOTS_PER_PART, slot_end, BLOCK_W):
        r = r0 + tl.arange(0, BLOCK_W)
        in_window = r < slot_end
        positions = first + (r + window - first % window) % window
        rows = ring + r.to(tl.int64) * stride_w_slot
        k = tl.load(k_window_ptr + rows[:, None] + d[None, :],
                    mask=in_window[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
        scores = tl.dot(k.to(q_orig.dtype), q_orig)
        scores = _mask_scores(scores * q_scale, positions, mask_ptr, b, q_head, row_ok,
                              stride_mask_b, stride_mask_h, mask_len, MASK)  # fmt: skip
        scores = tl.where(in_window[:, None], scores, float("-inf"))
        m_w, m_sub, alpha = _softmax_rescale(tl.max(scores, axis=0), m_w)
        p = tl.math.exp2(scores - m_sub[None, :])
        l_w = l_w * alpha + tl.sum(p, axis=0)
        if WINDOW_F32:
            pv = p
        else:
            pv = p.to(tl.float16)
        v_t = tl.load(v_window_ptr + rows[None, :] + d[:, None],
                      mask=in_window[None, :] & (d < D)[:, None], other=0.0)  # fmt: skip
        acc_w = tl.dot(v_t.to(pv.dtype), pv, acc_w * alpha[None, :])
    lse, inv_l = _partial_normalizer(m_w, l_w)
    part_rows = q_rows * NUM_PARTIALS + NUM_SPLITS + part
    out_ptrs = part_out_ptr + part_rows[None, :] * D + d[:, None]
    tl.store(out_ptrs, acc_w * inv_l[None, :], mask=row_ok[None, :] & (d < D)[:, None])
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)
    if PDL:
        gdc_wait()  # for the split kernel: the merge waits only for this one


@triton.jit
def _query_part(
    q_orig_ptr,
    stride_qb,
    stride_qh,
    b,
    q_head,
    row_ok,
    q_scale,
    PART: tl.constexpr,
    PC: tl.constexpr,
    PC_PAD: tl.constexpr,
):
    """Part ``PART`` of the group's unrotated queries times ``q_scale``, transposed: ``[PC_PAD,
    G_PAD]`` fp16 (keys that are not rotated need no preparation launch)."""
    j = tl.arange(0, PC_PAD)[:, None]
    q_rows = q_orig_ptr + b.to(tl.int64) * stride_qb + q_head[None, :] * stride_qh
    q_part = tl.load(q_rows + PART * PC + j, mask=row_ok[None, :] & (j < PC), other=0.0)
    return (q_part.to(tl.float32) * q_scale).to(tl.float16)


@triton.jit
def _rotate_query(
    q_orig_ptr,
    stride_qb,
    stride_qh,
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
    here instead of by the preparation kernel (short contexts, where that launch would be on
    the critical path).

    For a power-of-two D, ``R = diag(s) @ H`` with ``H`` Walsh-Hadamard and ``s = R[:, 0]``, so
    ``q @ R = (q * s) @ H``: a butterfly over each query row (:func:`_walsh_hadamard_rows`,
    float32 adds), and only R's first column is read. Parts are contiguous ranges of ``PC``
    outputs, split off the transposed rows.
    """
    d = tl.arange(0, D)
    q_rows = q_orig_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
    x = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    x *= tl.load(rot_ptr + d * D)[None, :] * (INV_SQRT_D * q_scale)
    y = _walsh_hadamard_rows(x, D, LOG2_D)  # [G_PAD, D]
    G_PAD: tl.constexpr = y.shape[0]
    tl.static_assert(PARTS > 1, "rotated keys have 2 (4-bit) or 4 (2- and 3-bit) parts")
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
def _split_kernel(
    q_ptr,
    q_orig_ptr,
    stride_qb,
    stride_qh,
    q_scale,
    rot_ptr,
    k_codes_ptr,
    v_codes_ptr,
    meta_ptr,
    stride_kc_page,
    stride_kc_head,
    stride_kc_slot,
    stride_vc_page,
    stride_vc_head,
    stride_m_page,
    stride_m_head,
    stride_m_slot,
    block_table_ptr,
    stride_bt_b,
    stride_bt_p,
    seq_lens_ptr,
    codebooks_ptr,
    mask_ptr,
    stride_mask_b,
    stride_mask_h,
    mask_len,
    window,
    k_window_ptr,
    v_window_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    max_pages,
    MASK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    LOG2_D: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBTILES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    ONE_TILE: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_META: tl.constexpr,
    K_OFF1: tl.constexpr,
    K_PARTS: tl.constexpr,
    K_PC: tl.constexpr,
    K_PC_PAD: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_META: tl.constexpr,
    V_OFF1: tl.constexpr,
    V_PARTS: tl.constexpr,
    V_PC: tl.constexpr,
    V_PC_PAD: tl.constexpr,
    CODEBOOK_STRIDE: tl.constexpr,
    K_ASM: tl.constexpr,
    V_ASM: tl.constexpr,
    QUERY: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    RING: tl.constexpr,
    RING_BLOCK: tl.constexpr,
    RING_QK_F32: tl.constexpr,
    RING_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    split = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    if PDL:
        # Programmatic dependent launch: the kernel after this one (window or merge) may launch
        # once every program of this one has started; when this kernel was launched that way
        # itself, everything but q_code, which the query preparation writes, was ready before.
        gdc_launch_dependents()

    # This split's token range of the compressed positions [0, len - W), from the device-side
    # length: [start, end). The window's min(len, W) ring tokens are read below (RING) or by
    # the window kernel.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_pages * PAGE_SIZE + window)
    compressed_len = seq_len - tl.minimum(seq_len, window)
    tile_tokens: tl.constexpr = SUBTILES * BLOCK_N
    if ONE_TILE:
        # A split of at most one tile sits at a fixed place, so its block-table entries are read
        # here, beside the length and before the query rotation, not after them: one dependent
        # round trip fewer on the path that short contexts wait for.
        start = split * tile_tokens
        capacity = max_pages * PAGE_SIZE
        n_first = start + tl.arange(0, BLOCK_N)
        early_a = _table_entries(n_first, n_first < capacity, b, block_table_ptr, stride_bt_b,
                                 stride_bt_p, PAGE_SIZE)  # fmt: skip
        if SUBTILES == 2:
            n_second = n_first + BLOCK_N
            early_b = _table_entries(n_second, n_second < capacity, b, block_table_ptr,
                                     stride_bt_b, stride_bt_p, PAGE_SIZE)  # fmt: skip
        end = tl.minimum(start + tile_tokens, compressed_len)
    else:
        per_split = tl.cdiv(tl.cdiv(compressed_len, NUM_SPLITS), tile_tokens) * tile_tokens
        start = split * per_split
        end = tl.minimum(start + per_split, compressed_len)

    # The GQA group's prepared queries, transposed: fp16 [K_PC_PAD, G_PAD] per part, the B
    # operands of S^T = K @ Q^T (columns >= GROUP: 0). Tokens are the M dimension of both
    # products, so the group is padded to the tensor cores' N = 8, not to M = 16. Unrotated keys
    # scale the query here (one part: 8 bits); rotated keys read q_code (_prep_query_kernel) or,
    # at short contexts, rotate it here.
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_head = head * GROUP + g
    q_rows = (b * num_kv_heads * GROUP + q_head).to(tl.int64)
    if QUERY == _QUERY_SCALED:
        q0 = _query_part(q_orig_ptr, stride_qb, stride_qh, b, q_head, row_ok, q_scale, 0, K_PC,
                         K_PC_PAD)  # fmt: skip
        q1 = q0
        q2 = q0
        q3 = q0
    elif QUERY == _QUERY_ROTATED_HERE:
        q0, q1, q2, q3 = _rotate_query(q_orig_ptr, stride_qb, stride_qh, rot_ptr, b, q_head,
                                       row_ok, q_scale, D, LOG2_D, INV_SQRT_D, K_PARTS,
                                       K_PC)  # fmt: skip
    else:
        q_part = q_ptr + q_rows[:, None] * (K_PARTS * K_PC_PAD)
        q_part += tl.arange(0, K_PC_PAD)[None, :]
        if PDL:
            gdc_wait()  # for _prep_query_kernel's q_code
        q0 = tl.trans(tl.load(q_part, mask=row_ok[:, None], other=0.0))
        q1 = tl.trans(tl.load(q_part + K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 1), other=0.0))
        q2 = tl.trans(
            tl.load(q_part + 2 * K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 2), other=0.0)
        )
        q3 = tl.trans(
            tl.load(q_part + 3 * K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 2), other=0.0)
        )

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    # O^T = V^T @ P^T per value part: [V_PC_PAD, G_PAD] float32
    acc0 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc1 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc2 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    acc3 = tl.zeros([V_PC_PAD, G_PAD], tl.float32)
    zero_acc = tl.zeros([G_PAD], tl.float32)
    k_head = head.to(tl.int64) * stride_kc_head
    v_head = head.to(tl.int64) * stride_vc_head
    m_head = head.to(tl.int64) * stride_m_head
    # Each iteration streams SUBTILES tiles of BLOCK_N tokens that share one softmax update
    # (running max, rescale of the accumulators), which amortizes its cross-lane reductions
    # while the codes are still decoded BLOCK_N tokens at a time.
    for tile_start in range(start, end, SUBTILES * BLOCK_N):
        n_a = tile_start + tl.arange(0, BLOCK_N)
        if ONE_TILE:
            table_a = tl.where(n_a < end, early_a, 0)  # read past the length, not followed
        else:
            table_a = _table_entries(n_a, n_a < end, b, block_table_ptr, stride_bt_b,
                                     stride_bt_p, PAGE_SIZE)  # fmt: skip
        scores_a, page_a, slot_a, m_row_a, valid_a = _key_scores(
            n_a, end, table_a, b, k_codes_ptr, k_head,
            stride_kc_page, stride_kc_slot, meta_ptr, m_head, stride_m_page, stride_m_slot,
            codebooks_ptr, q0, q1, q2, q3, mask_ptr, q_head, row_ok, stride_mask_b,
            stride_mask_h, mask_len, MASK, PAGE_SIZE, D, K_KIND, K_BITS, K_META, K_OFF1,
            K_PARTS, K_PC, K_PC_PAD, K_ASM,
        )  # fmt: skip
        tile_max = scores_a
        if SUBTILES == 2:
            n_b = n_a + BLOCK_N
            if ONE_TILE:
                table_b = tl.where(n_b < end, early_b, 0)
            else:
                table_b = _table_entries(n_b, n_b < end, b, block_table_ptr, stride_bt_b,
                                         stride_bt_p, PAGE_SIZE)  # fmt: skip
            scores_b, page_b, slot_b, m_row_b, valid_b = _key_scores(
                n_b, end, table_b, b, k_codes_ptr, k_head,
                stride_kc_page, stride_kc_slot, meta_ptr, m_head, stride_m_page, stride_m_slot,
                codebooks_ptr, q0, q1, q2, q3, mask_ptr, q_head, row_ok, stride_mask_b,
                stride_mask_h, mask_len, MASK, PAGE_SIZE, D, K_KIND, K_BITS, K_META, K_OFF1,
                K_PARTS, K_PC, K_PC_PAD, K_ASM,
            )  # fmt: skip
            tile_max = tl.maximum(scores_a, scores_b)
        m_i, m_sub, alpha = _softmax_rescale(tl.max(tile_max, axis=0), m_i)
        p_a = tl.math.exp2(scores_a - m_sub[None, :])
        p_sum = p_a
        if SUBTILES == 2:
            p_b = tl.math.exp2(scores_b - m_sub[None, :])
            p_sum = p_a + p_b
        l_i = l_i * alpha + tl.sum(p_sum, axis=0)
        zero_acc *= alpha
        acc0 *= alpha[None, :]
        acc1 *= alpha[None, :]
        acc2 *= alpha[None, :]
        acc3 *= alpha[None, :]
        acc0, acc1, acc2, acc3, zero_acc = _value_update(
            p_a, page_a, slot_a, m_row_a, valid_a, acc0, acc1, acc2, acc3, zero_acc, v_codes_ptr,
            v_head, stride_vc_page, codebooks_ptr + CODEBOOK_STRIDE, PAGE_SIZE, TOKEN_RUN, D,
            V_KIND, V_BITS, V_META, V_OFF1, V_PARTS, V_PC, V_PC_PAD, V_ASM,
        )  # fmt: skip
        if SUBTILES == 2:
            acc0, acc1, acc2, acc3, zero_acc = _value_update(
                p_b, page_b, slot_b, m_row_b, valid_b, acc0, acc1, acc2, acc3, zero_acc,
                v_codes_ptr, v_head, stride_vc_page, codebooks_ptr + CODEBOOK_STRIDE, PAGE_SIZE,
                TOKEN_RUN, D, V_KIND, V_BITS, V_META, V_OFF1, V_PARTS, V_PC, V_PC_PAD, V_ASM,
            )  # fmt: skip

    if RING:
        # The ring's RING_BLOCK-slot tiles, round robin over the splits from the last one (which
        # may hold fewer compressed tiles) down: each split takes about W / NUM_SPLITS more
        # tokens, into the same softmax state and accumulators (values not rotated). The ring
        # holds window_len = min(len, W) positions from compressed_len, slot r the one that is r
        # mod W, so its written slots are [0, window_len): a tile is a run of consecutive rows
        # (no wrap), and a slot's position matters only to a mask.
        rq0, rq1, rq2, rq3 = _ring_query(q_orig_ptr, stride_qb, stride_qh, b, q_head, row_ok, D,
                                         D_PAD, RING_QK_F32)  # fmt: skip
        ring = b.to(tl.int64) * stride_w_b + head.to(tl.int64) * stride_w_h
        window_len = seq_len - compressed_len
        for r0 in tl.range((NUM_SPLITS - 1 - split) * RING_BLOCK, window_len,
                           NUM_SPLITS * RING_BLOCK, num_stages=2):  # fmt: skip
            slot = r0 + tl.arange(0, RING_BLOCK)
            in_ring = slot < window_len
            rows = slot * stride_w_slot
            scores = _ring_key_scores(k_window_ptr + ring + rows[:, None], in_ring, rq0, rq1, rq2,
                                      rq3, D) * q_scale  # fmt: skip
            positions = compressed_len + (slot + window - compressed_len % window) % window
            scores = _mask_scores(scores, positions, mask_ptr, b, q_head, row_ok, stride_mask_b,
                                  stride_mask_h, mask_len, MASK)  # fmt: skip
            scores = tl.where(in_ring[:, None], scores, float("-inf"))
            m_i, m_sub, alpha = _softmax_rescale(tl.max(scores, axis=0), m_i)
            p = tl.math.exp2(scores - m_sub[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            zero_acc *= alpha
            acc0, acc1, acc2, acc3 = _ring_values(
                p, v_window_ptr + ring + rows[None, :], in_ring, acc0 * alpha[None, :],
                acc1 * alpha[None, :], acc2 * alpha[None, :], acc3 * alpha[None, :], V_PARTS,
                V_PC, V_PC_PAD, RING_F32,
            )  # fmt: skip

    # This split's partial, normalized, in natural element order; lse in the log2 domain.
    lse, inv_l = _partial_normalizer(m_i, l_i)
    part_rows = q_rows * NUM_PARTIALS + split
    j = tl.arange(0, V_PC_PAD)[:, None]
    out_ptrs = part_out_ptr + part_rows[None, :] * D + j
    ok = row_ok[None, :] & (j < V_PC)
    scale = inv_l[None, :]
    tl.store(out_ptrs, (acc0 + zero_acc[None, :]) * scale, mask=ok)
    if V_PARTS > 1:
        tl.store(out_ptrs + V_PC, (acc1 + zero_acc[None, :]) * scale, mask=ok)
    if V_PARTS > 2:
        tl.store(out_ptrs + 2 * V_PC, (acc2 + zero_acc[None, :]) * scale, mask=ok)
        tl.store(out_ptrs + 3 * V_PC, (acc3 + zero_acc[None, :]) * scale, mask=ok)
    tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)


@triton.jit
def _walsh_hadamard_rows(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``x @ H`` for ``x [M, D]`` float32 and the Walsh-Hadamard matrix ``H`` of a power-of-two
    ``D`` (Sylvester order, ``H[i, j] = (-1)^popcount(i & j)``, the ``H`` of
    :func:`custom_ops.codebook.rotation_matrix`): ``log2(D)`` butterfly stages, stage ``k``
    mapping the pair of elements ``i``, ``i + 2^k`` (bit ``k`` of ``i`` clear) to their sum and
    difference."""
    M: tl.constexpr = x.shape[0]
    for k in tl.static_range(LOG2_D):
        pairs = tl.permute(tl.reshape(x, [M, D >> (k + 1), 2, 1 << k]), [0, 1, 3, 2])
        low, high = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(low + high, low - high), [0, 1, 3, 2]), [M, D])
    return x


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    num_rows,
    NUM_SPLITS: tl.constexpr,
    WINDOW_PARTS: tl.constexpr,
    WINDOW_PARTS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROTATE_BACK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    LOG2_D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[row] = sum_s w_s * o_s / sum_s w_s`` with ``w_s = exp2(lse_s - max lse)`` for the
    ``BLOCK_M`` rows ``b * Hq + h`` of this program, ``SPLIT_CHUNK`` splits at a time. Rotated
    values go back by a Walsh-Hadamard butterfly for power-of-two head dims (only R's first
    column is read), otherwise by ``[BLOCK_M, D] @ R^T`` products (R read once per ``BLOCK_M``
    rows); the window's ``WINDOW_PARTS`` partials (after the splits') are in the original space
    already."""
    NUM_PARTIALS: tl.constexpr = NUM_SPLITS + WINDOW_PARTS
    if PDL:
        gdc_wait()  # for every partial
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows[:, None] < num_rows
    split_lse = tl.load(part_lse_ptr + rows[:, None] * NUM_PARTIALS + tl.arange(0, NUM_SPLITS),
                        mask=row_ok, other=float("-inf"))  # fmt: skip
    m = tl.max(split_lse, axis=1)
    # [BLOCK_M, WINDOW_PARTS_PAD] partial rows and lse of the window
    window_part = tl.arange(0, WINDOW_PARTS_PAD)[None, :]
    window_rows = rows[:, None] * NUM_PARTIALS + NUM_SPLITS + window_part
    window_ok = row_ok & (window_part < WINDOW_PARTS)
    window_lse = tl.load(part_lse_ptr + window_rows, mask=window_ok, other=float("-inf"))
    m = tl.maximum(m, tl.max(window_lse, axis=1))
    m = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(
        tl.where(split_lse > float("-inf"), tl.math.exp2(split_lse - m[:, None]), 0.0), axis=1
    )
    d = tl.arange(0, D_PAD)[None, None, :]
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s0 in range(0, NUM_SPLITS, SPLIT_CHUNK):
        part_rows = rows[:, None] * NUM_PARTIALS + s0 + tl.arange(0, SPLIT_CHUNK)[None, :]
        lse = tl.load(part_lse_ptr + part_rows, mask=row_ok, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m[:, None]), 0.0)
        parts = tl.load(part_out_ptr + part_rows[:, :, None] * D + d,
                        mask=row_ok[:, :, None] & (d < D), other=0.0)  # fmt: skip
        acc += tl.sum(parts * w[:, :, None], axis=1)
    window_w = tl.where(window_lse > float("-inf"), tl.math.exp2(window_lse - m[:, None]), 0.0)
    total += tl.sum(window_w, axis=1)
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
    if ROTATE_BACK and D == D_PAD:
        # x = y @ R.T / sqrt(D) = (y @ H) * s / sqrt(D) for a power-of-two D (R = diag(s) @ H,
        # Walsh-Hadamard H, s = R[:, 0]): a butterfly in registers, exact in float32
        j = tl.arange(0, D)
        signs = tl.load(rot_ptr + j * D) * INV_SQRT_D
        out = _walsh_hadamard_rows(acc, D, LOG2_D) * signs[None, :]
        _merge_store(out, j, rows, row_ok, window_rows, window_ok, window_w, inv_total,
                     part_out_ptr, out_ptr, WINDOW_PARTS, D)  # fmt: skip
    elif ROTATE_BACK:
        # padded head dims: x = y @ R.T / sqrt(D), 64 output columns at a time: rot_t[i, j] =
        # R[j, i]
        CHUNK: tl.constexpr = min(64, D_PAD)
        i = tl.arange(0, D_PAD)[:, None]
        for j0 in tl.static_range(0, D_PAD, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            rot_t = tl.load(rot_ptr + j[None, :] * D + i, mask=(i < D) & (j < D)[None, :],
                            other=0.0)  # fmt: skip
            out = tl.dot(acc, rot_t, input_precision="ieee") * INV_SQRT_D
            _merge_store(out, j, rows, row_ok, window_rows, window_ok, window_w, inv_total,
                         part_out_ptr, out_ptr, WINDOW_PARTS, D)  # fmt: skip
    else:
        _merge_store(acc, tl.arange(0, D_PAD), rows, row_ok, window_rows, window_ok, window_w,
                     inv_total, part_out_ptr, out_ptr, WINDOW_PARTS, D)  # fmt: skip


@triton.jit
def _merge_store(
    out,
    j,
    rows,
    row_ok,
    window_rows,
    window_ok,
    window_w,
    inv_total,
    part_out_ptr,
    out_ptr,
    WINDOW_PARTS: tl.constexpr,
    D: tl.constexpr,
):
    """Columns ``j`` of the merged rows: ``(out + sum_w window_w * window_partial) / total``,
    stored in the output's dtype."""
    col_ok = row_ok & (j < D)[None, :]
    if WINDOW_PARTS > 0:
        jj = j[None, None, :]
        window_out = tl.load(part_out_ptr + window_rows[:, :, None] * D + jj,
                             mask=window_ok[:, :, None] & (jj < D), other=0.0)  # fmt: skip
        out += tl.sum(window_out * window_w[:, :, None], axis=1)
    out_ptrs = out_ptr + rows[:, None] * D + j[None, :]
    tl.store(out_ptrs, (out * inv_total[:, None]).to(out_ptr.dtype.element_ty), mask=col_ok)


def _merge_block(
    num_rows: int, num_splits: int, d_pad: int, rotate_by_product: bool, device: torch.device
):
    """``(BLOCK_M, SPLIT_CHUNK, num_warps)`` of the merge: as many rows per program as keep two
    programs per SM busy (up to 16, so a rotation is read once per 16 rows), and at most 256
    partials in registers at a time.

    A program of one row whose partials fit one warp's registers (``_MERGE_LANE_FLOATS`` per
    lane) gets one warp and one chunk: with more warps, Triton lays them along the splits (the
    row's ``D`` fills a warp's lanes) and sums over them through shared memory, which cost
    about 1.1 us at 1 x 1024 and 2.5-5.5 us at 4 x 32768 and 16 x 8192 (H100, NOTES.md
    "Decode v7"). Rows of more partials keep four warps: one warp looping over chunks was
    slower. So does a rotation back by products with R (``rotate_by_product``: rotated values,
    head dim not a power of two), whose ``[D_PAD, 64]`` blocks of R would spill in one warp."""
    block_m = 16
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        while block_m > 1 and num_rows < 2 * sm_count * block_m:
            block_m //= 2
    fits_one_warp = num_splits * d_pad <= 32 * _MERGE_LANE_FLOATS and not rotate_by_product
    if block_m == 1 and fits_one_warp:
        return 1, num_splits, 1
    return block_m, min(num_splits, max(1, 256 // block_m)), _MERGE_WARPS


# Programs of the split kernel per SM that the default split count aims at (each holds
# DEFAULT_WARPS warps), and the fewest tokens worth a split of its own.
_PROGRAMS_PER_SM = 8
_MIN_SPLIT_TOKENS = 32


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """A fixed split count for a cache: about ``_PROGRAMS_PER_SM`` programs per SM, at least
    ``_MIN_SPLIT_TOKENS`` tokens per split.

    Chosen once from the cache's capacity (``batch`` x ``max_seq_len``) and the GPU's SM count,
    never from the current lengths, so a captured graph stays valid as sequences grow.
    """
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count, max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return min(512, triton.next_power_of_2(max(1, min(wanted, by_length))))


def _token_run(page_size: int, block_n: int) -> int:
    """How many adjacent bytes of a value-code column belong to consecutive tokens of a tile,
    aligned: tiles start at multiples of ``block_n``, so a power-of-two page gives runs of
    ``min(page_size, block_n)``; other page sizes get no vectorization hint."""
    if page_size & (page_size - 1):
        return 1
    return min(page_size, block_n)


def _part_params(codec, head_dim: int) -> tuple[int, int, int]:
    parts = parts_of(codec)
    chunk = head_dim // parts
    return parts, chunk, triton.next_power_of_2(chunk)


def _side_constexprs(prefix: str, fmt: KVFormat, side: str, head_dim: int) -> dict:
    codec = fmt.key if side == "k" else fmt.value
    common = codec_constexprs(prefix, codec, first_meta_column(fmt, side), head_dim)
    parts, chunk, chunk_pad = _part_params(codec, head_dim)
    keep = ("KIND", "BITS", "META", "OFF1")
    return {
        **{f"{prefix}_{k}": common[f"{prefix}_{k}"] for k in keep},
        f"{prefix}_PARTS": parts,
        f"{prefix}_PC": chunk,
        f"{prefix}_PC_PAD": chunk_pad,
    }


def _split_launch(
    fmt,
    q,
    cache,
    block_table,
    seq_lens,
    rotation,
    codebooks,
    num_splits,
    block_n,
    fast,
    num_warps,
    num_stages,
    subtiles,
    mask=None,
    scale=1.0,
    k_window=None,
    v_window=None,
):
    """Buffers ``(q_code, part_out, part_lse)``, the grid, positional and keyword arguments of
    ``_split_kernel`` for query ``q [B, Hq, D]``, and the mask's ``(kind, args)``, for a
    recent window in the rings ``k_window``/``v_window`` ``[B, Hk, W, D]`` (None: none).
    ``block_n`` and ``subtiles`` of None take :func:`tile_config`'s."""
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    group = num_q_heads // num_kv_heads
    grid = (num_splits, num_kv_heads, batch)
    if num_warps is None:
        num_warps = _split_warps(math.prod(grid), q.device)
    pdl = _use_pdl(fast, q.device)
    capacity = block_table.shape[1] * page_size
    # both configurations read DEFAULT_BLOCK_N tokens per step, so one-tile splits are the same
    default_block_n, default_subtiles = tile_config(
        fmt, _one_tile(capacity, num_splits, DEFAULT_BLOCK_N * DEFAULT_SUBTILES)
    )
    block_n = default_block_n if block_n is None else block_n
    subtiles = default_subtiles if subtiles is None else subtiles
    one_tile = _one_tile(capacity, num_splits, subtiles * block_n)
    query = _query_mode(fmt, head_dim, capacity, num_splits)
    window = 0 if k_window is None else k_window.shape[2]
    ring = _ring_in_split(fmt, window)
    num_partials = num_splits + (0 if ring else window_parts(window)[0])
    q_code, part_out, part_lse = _buffers(fmt, q, query, num_partials)
    if mask is None:
        mask_kind, mask_args = 0, (seq_lens, 0, 0, 0)
    else:
        # [B or 1, Hq or 1, S] -> broadcast strides; bool masks are read as bytes
        mask = mask.expand(batch, num_q_heads, mask.shape[-1])
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_kind = 1 if mask.dtype == torch.bool else 2
        data = mask.view(torch.uint8) if mask_kind == 1 else mask
        mask_args = (data, mask.stride(0), mask.stride(1), mask.shape[-1])
    args = (
        q_code, q, q.stride(0), q.stride(1), scale * LOG2E, rotation, cache.k_codes, cache.v_codes,
        cache.meta, *cache.k_codes.stride()[:3], *cache.v_codes.stride()[:2],
        *cache.meta.stride()[:3], block_table, *block_table.stride(), seq_lens, codebooks,
        # the rings and their strides, or placeholders that a kernel without RING never reads
        *mask_args, window, *((k_window, v_window, *k_window.stride()[:3]) if ring
                              else (q, q, 0, 0, 0)),
        part_out, part_lse, num_kv_heads, block_table.shape[1],
    )  # fmt: skip
    kwargs = dict(
        MASK=mask_kind,
        PAGE_SIZE=page_size,
        TOKEN_RUN=_token_run(page_size, block_n),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        LOG2_D=triton.next_power_of_2(head_dim).bit_length() - 1,
        GROUP=group,
        G_PAD=triton.next_power_of_2(group),
        BLOCK_N=block_n,
        SUBTILES=subtiles,
        NUM_SPLITS=num_splits,
        NUM_PARTIALS=num_partials,
        ONE_TILE=one_tile,
        **_side_constexprs("K", fmt, "k", head_dim),
        **_side_constexprs("V", fmt, "v", head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        K_ASM=decode_asm(fmt.key, head_dim) if fast else "",
        V_ASM=decode_asm(fmt.value, head_dim) if fast else "",
        QUERY=query,
        INV_SQRT_D=1.0 / math.sqrt(head_dim),
        RING=ring,
        RING_BLOCK=_RING_BLOCK,
        RING_QK_F32=ring and (not fast or k_window.dtype != q.dtype),
        RING_F32=not fast,
        # without the query preparation, what runs before this kernel is not ours: launch it
        # normally
        PDL=pdl,
        **({"launch_pdl": True} if pdl and query == _QUERY_PREPARED.value else {}),
        num_warps=num_warps,
        num_stages=num_stages,
        **_register_cap(fmt, one_tile, ring),
    )
    return (q_code, part_out, part_lse), grid, args, kwargs, (mask_kind, mask_args)


def _split_warps(num_programs: int, device: torch.device) -> int:
    """Warps per split program: ``DEFAULT_WARPS``, or two where the grid leaves SMs idle (at
    most two programs per SM, so each of an SM's four schedulers gets one warp): each warp then
    decodes half of its tile's tokens and value rows, which shortens the one dependent chain
    that short contexts wait for (1 x 1024, H100: 0.15-0.45 us faster for every format but
    k2v2_nc, which is even; NOTES.md "Decode v7")."""
    if device.type != "cuda":
        return DEFAULT_WARPS
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return 2 if num_programs <= 2 * sm_count else DEFAULT_WARPS


def _ring_in_split(fmt: KVFormat, window: int) -> bool:
    """Whether the split kernel reads the recent window's ring itself, into the softmax state and
    accumulators of its compressed tiles, instead of ``_window_kernel`` (NOTES.md "Decode v8"
    and "Decode v9"): for values in the original space. Rotated values accumulate in the code
    space, where the ring would have to be rotated into."""
    return window > 0 and not fmt.value.rotated


def _one_tile(capacity: int, num_splits: int, tile_tokens: int) -> bool:
    """Whether every split of a cache of ``capacity`` positions holds at most one tile, at a
    place fixed by its index, so the split kernel reads its block-table entries without waiting
    for the length (short contexts)."""
    return capacity <= num_splits * tile_tokens


# Formats whose streaming loop ptxas gives more registers than one-warp programs can have at
# 16 per SM (fp8: 152, tq4_nc: 168 uncapped, so 13 / 12 programs), and the cap that restores
# that occupancy (H100, NOTES.md "Register cap for fp8 and tq4_nc").
_CAPPED_FORMATS = ("fp8", "tq4_nc")
_SPLIT_MAX_REGISTERS = 128


def _register_cap(fmt: KVFormat, one_tile: bool, ring: bool) -> dict:
    """ptxas options of the split kernel: ``maxnreg`` for the loop of :data:`_CAPPED_FORMATS`
    (+61 / +19 loop instructions, 5-9% / 3-6% faster at long contexts), and for a kernel that
    reads the ring (``ring``), whose loop would otherwise raise the registers past the 16
    one-warp programs per SM that the split count assumes. Splits of one tile keep their
    registers: occupancy does not matter there, and capped, tq4_nc's query rotation spills
    (1x1024: 7.1 -> 7.6 us)."""
    if (fmt.name in _CAPPED_FORMATS or ring) and not one_tile:
        return {"maxnreg": _SPLIT_MAX_REGISTERS}
    return {}


# Rotated keys get their queries rotated inside the split kernel (one launch fewer) when a split
# holds at most this many tokens of the cache's capacity: there the launch is on the critical
# path, and at longer splits the preparation kernel is cheaper than one rotation per program.
_ROTATE_HERE_MAX_TOKENS = 128


def _query_mode(fmt: KVFormat, head_dim: int, capacity: int, num_splits: int) -> int:
    """How the split kernel gets its queries (``_QUERY_*``) for a cache of ``capacity``
    positions: rotating in the split kernel needs the Walsh-Hadamard structure of R (a
    power-of-two head dim) and parts of at least 16 elements."""
    if not fmt.key.rotated:
        return _QUERY_SCALED.value
    _, chunk, _ = _part_params(fmt.key, head_dim)
    power_of_two = head_dim & (head_dim - 1) == 0
    if power_of_two and chunk >= 16 and capacity <= _ROTATE_HERE_MAX_TOKENS * num_splits:
        return _QUERY_ROTATED_HERE.value
    return _QUERY_PREPARED.value


def window_parts(window: int) -> tuple[int, int]:
    """``(parts, slots_per_part)`` of a ring of ``window`` slots: the window kernel's programs
    per (sequence, kv-head), each over whole ``_BLOCK_W`` tiles; ``(0, 0)`` without a window."""
    if window == 0:
        return 0, 0
    parts = min(_MAX_WINDOW_PARTS, triton.cdiv(window, _BLOCK_W))
    slots = triton.cdiv(triton.cdiv(window, parts), _BLOCK_W) * _BLOCK_W
    return triton.cdiv(window, slots), slots


def _use_pdl(fast: bool, device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer, GPU code only): a kernel may launch while
    the one before it finishes, hiding the launch gaps that dominate short contexts."""
    return fast and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _buffers(fmt, q, query, num_partials):
    """``(q_code, part_out, part_lse)``; ``q_code`` is ``q`` itself (not read) unless the
    preparation kernel writes it."""
    batch, num_q_heads, head_dim = q.shape
    parts, _, chunk_pad = _part_params(fmt.key, head_dim)
    q_code = q
    if query == _QUERY_PREPARED.value:
        q_code = torch.empty(
            batch, num_q_heads, parts * chunk_pad, dtype=torch.float16, device=q.device
        )
    part_out = torch.empty(
        batch, num_q_heads, num_partials, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(batch, num_q_heads, num_partials, dtype=torch.float32, device=q.device)
    return q_code, part_out, part_lse


def decode(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    num_splits: int,
    scale: float,
    mask: torch.Tensor | None = None,
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
    block_n: int | None = None,
    fast: bool | None = None,
    num_warps: int | None = None,
    num_stages: int = DEFAULT_STAGES,
    subtiles: int | None = None,
) -> torch.Tensor:
    """Launch the decode kernels (inputs validated; see ``torch.ops.tq.decode``).

    ``fast`` selects the inline-PTX decoding (default: on CUDA; the interpreter cannot run it).
    ``block_n``, ``subtiles`` (tiles per softmax update, 1 or 2; both default to
    :func:`tile_config`), ``num_warps`` (default: :func:`_split_warps`) and ``num_stages`` tune
    the split kernel (see NOTES.md).
    """
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    fast = q.device.type == "cuda" if fast is None else fast
    window = 0 if k_window is None else k_window.shape[2]
    (q_code, part_out, part_lse), grid, args, kwargs, (mask_kind, mask_args) = _split_launch(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, block_n, fast,
        num_warps, num_stages, subtiles, mask, scale, k_window, v_window,
    )  # fmt: skip
    parts, chunk, chunk_pad = _part_params(fmt.key, head_dim)
    # shapes the split kernel's launch already derived, shared by the other kernels
    inv_sqrt_d, d_pad, pdl = kwargs["INV_SQRT_D"], kwargs["D_PAD"], kwargs["PDL"]
    num_partials = kwargs["NUM_PARTIALS"]
    num_rows = batch * num_q_heads
    # The first kernel is launched normally, after everything before it; the ones after it
    # with programmatic dependent launch where available (_use_pdl).
    if kwargs["QUERY"] == _QUERY_PREPARED.value:
        prep_grid = (triton.cdiv(num_rows, _PREP_ROWS), parts * chunk_pad // _PREP_COLUMNS)
        _prep_query_kernel[prep_grid](
            q, q.stride(0), q.stride(1), rotation, q_code, num_rows, num_q_heads, scale * LOG2E,
            D=head_dim, D_PAD=d_pad, INV_SQRT_D=inv_sqrt_d, PARTS=parts, PC=chunk,
            PC_PAD=chunk_pad, BLOCK_Q=_PREP_ROWS, BLOCK_C=_PREP_COLUMNS, PDL=pdl,
        )  # fmt: skip
    _split_kernel[grid](*args, **kwargs)
    num_window_parts, slots_per_part = window_parts(0 if kwargs["RING"] else window)
    if num_window_parts:
        num_kv_heads = cache.k_codes.shape[1]
        _window_kernel[(num_window_parts, num_kv_heads, batch)](
            q, q.stride(0), q.stride(1), scale * LOG2E, k_window, v_window,
            *k_window.stride()[:3], window, seq_lens,
            block_table.shape[1] * cache.k_codes.shape[2] + window, *mask_args, part_out,
            part_lse, num_kv_heads, MASK=mask_kind, D=head_dim, D_PAD=d_pad,
            GROUP=kwargs["GROUP"], G_PAD=kwargs["G_PAD"], BLOCK_W=_BLOCK_W,
            SLOTS_PER_PART=slots_per_part, NUM_SPLITS=num_splits, NUM_PARTIALS=num_partials,
            WINDOW_QK_F32=not fast or k_window.dtype != q.dtype, WINDOW_F32=not fast, PDL=pdl,
            num_warps=_WINDOW_WARPS, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    rotate_by_product = fmt.value.rotated and head_dim != d_pad
    block_m, split_chunk, merge_warps = _merge_block(
        num_rows, num_splits, d_pad, rotate_by_product, q.device
    )
    _merge_kernel[(triton.cdiv(num_rows, block_m),)](
        part_out, part_lse, rotation, out, num_rows, NUM_SPLITS=num_splits,
        WINDOW_PARTS=num_window_parts,
        WINDOW_PARTS_PAD=triton.next_power_of_2(max(1, num_window_parts)),
        SPLIT_CHUNK=split_chunk, BLOCK_M=block_m, ROTATE_BACK=fmt.value.rotated, D=head_dim,
        D_PAD=d_pad, LOG2_D=kwargs["LOG2_D"], INV_SQRT_D=inv_sqrt_d, PDL=pdl,
        num_warps=merge_warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


def compile_split_kernel(
    fmt,
    q,
    cache,
    block_table,
    seq_lens,
    rotation,
    codebooks,
    num_splits,
    block_n,
    compile_fn,
    fast=True,
    num_warps=DEFAULT_WARPS,
    num_stages=DEFAULT_STAGES,
    subtiles=DEFAULT_SUBTILES,
    k_window=None,
    v_window=None,
    **launch_options,
):
    """Compile (not launch) the split kernel for these inputs (with rings ``k_window``/
    ``v_window``, if given) through ``compile_fn(kernel, grid, *args, **kwargs)``; used by
    ``benchmarks/sass_report.py`` to inspect its SASS. ``launch_options`` (e.g. ``maxnreg``)
    go to the compiler."""
    _, grid, args, kwargs, _ = _split_launch(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, block_n, fast,
        num_warps, num_stages, subtiles, k_window=k_window, v_window=v_window,
    )  # fmt: skip
    return compile_fn(_split_kernel, grid, *args, **{**kwargs, **launch_options})
