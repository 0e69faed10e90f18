"""Split-KV decode attention over a compressed paged cache: ``torch.ops.tq.decode`` on CUDA.

Three launches with shapes fixed by the inputs (CUDA-graph safe, no host sync):

1. ``_prep_query_kernel`` (grid ``B * Hq``): rotates the query into the keys' code space
   (``q @ R / sqrt(D)`` for Lloyd-Max keys), multiplies by ``scale * log2(e)`` so the softmax can
   use ``exp2``, and writes it as fp16 in the keys' *parts* (below).
2. ``_split_kernel`` (grid ``(num_splits, Hk, B)``): one program per (sequence, kv-head, split)
   serves every q-head of the GQA group, so each cache byte is read once. Each split finds its
   token range from ``seq_lens`` on the device (an empty split writes a neutral partial), then
   streams ``BLOCK_N``-token tiles: ``S = Q @ K^T`` and ``P @ V`` on the tensor cores with the
   group padded to 16 rows, an online softmax in the log2 domain, and the codecs' scalars folded
   in: the key norm/scale multiplies the scores, the value scale multiplies the probabilities
   before ``P @ V`` and the value zero enters through a running ``sum(p * zero)``.
3. ``_merge_kernel`` (grid ``B * Hq``): log-sum-exp merge of the splits; rotates Lloyd-Max values
   back to the original space and casts to the query's dtype.

Recent window: with a full-precision ring of the last ``W`` tokens (``k_window``/``v_window``),
the splits cover the compressed positions ``[0, len - W)``, and the split in whose range they
end goes on over the ring's tiles in full precision, in the same online softmax and value
accumulators (rotated into the values' code space for rotated values). Splits are sized over
all ``len`` tokens, so that split does not run long, and there is no extra program or launch.

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

from custom_ops.formats import Kind, KVFormat, PagedKVCache
from custom_ops.triton.decode_asm import decode_asm, parts_of
from custom_ops.triton.store import codec_constexprs, first_meta_column

_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
_FP8 = tl.constexpr(int(Kind.FP8))
_FP8_ABSMAX = tl.constexpr(int(Kind.FP8_ABSMAX))
_INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))
LOG2E = 1.4426950408889634
LOG2E_ = tl.constexpr(LOG2E)
_BLOCK_W = 32  # ring slots per tile of the recent window
# Split-kernel defaults (benchmarks/NOTES.md has the sweep): one or two warps per program keep
# the softmax reductions and the P^T operand inside a warp.
DEFAULT_BLOCK_N = 32
DEFAULT_WARPS = 1
DEFAULT_STAGES = 2


@triton.jit
def _prep_query_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    rot_ptr,
    out_ptr,
    num_q_heads,
    q_scale,
    ROTATE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PARTS: tl.constexpr,
    PC: tl.constexpr,
    PC_PAD: tl.constexpr,
):
    """``out[b, h, p * PC_PAD + j] = (q[b, h] @ R / sqrt(D))[p * PC + j] * q_scale`` as fp16."""
    row = tl.program_id(0)
    b = row // num_q_heads
    h = row % num_q_heads
    q_row = q_ptr + b * stride_qb + h * stride_qh
    i = tl.arange(0, PARTS * PC_PAD)
    elem = (i // PC_PAD) * PC + i % PC_PAD
    ok = (i % PC_PAD) < PC
    if ROTATE:
        d = tl.arange(0, D_PAD)
        q = tl.load(q_row + d, mask=d < D, other=0.0).to(tl.float32)
        rot_mask = (d[:, None] < D) & ok[None, :]
        rot = tl.load(rot_ptr + d[:, None] * D + elem[None, :], mask=rot_mask, other=0.0)
        q_code = tl.sum(q[:, None] * rot, axis=0) * INV_SQRT_D
    else:
        q_code = tl.load(q_row + elem, mask=ok, other=0.0).to(tl.float32)
    q_code = tl.where(ok, q_code * q_scale, 0.0)
    tl.store(out_ptr + row * (PARTS * PC_PAD) + i, q_code.to(tl.float16))


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
):
    """Decode a tile of code rows into up to four parts (fp16, the tile's shape, *before* the
    per-token scalars; unused parts repeat part 0).

    ``row_offsets`` (offsets of byte 0 of each token's row) and ``j`` (byte of a plane part)
    broadcast to the tile: ``[N, 1]`` and ``[1, PC]`` for keys (token-major, ``BYTE_STRIDE`` 1),
    ``[1, N]`` and ``[PC, 1]`` for values (token-minor, ``BYTE_STRIDE = page_size``), whose
    tokens come in runs of ``TOKEN_RUN`` adjacent bytes (page-aligned; 1: no hint). The inline
    asm packs 4 consecutive bytes of the tile's last axis: 4 elements of a key, or one byte
    column of 4 tokens of values.
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
        # element j' + r*D/8 at bit r, re-read here so that byte j holds the top bit of element
        # j + q*D/4 at bit 2q, like the 2-bit plane.
        D8: tl.constexpr = D // 8
        sign_offsets = row_offsets + (OFF1 + j % D8) * BYTE_STRIDE
        if TOKEN_RUN > 1:
            sign_offsets = tl.max_contiguous(
                tl.multiple_of(sign_offsets, [1, TOKEN_RUN]), [1, TOKEN_RUN]
            )
        signs = tl.load(codes_ptr + sign_offsets, mask=mask, other=0)
        signs = (signs >> (j // D8)).to(tl.uint8)
        if ASM != "":
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                ASM,
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
                [plane, signs],
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
def _online_softmax(scores, m_i, l_i):
    """One tile ``scores [N, G_PAD]`` of the online softmax in the log2 domain:
    ``(p, alpha, m_new, l_new)``. A query masked out so far keeps ``m = -inf``, so 0 is
    subtracted instead."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=0))
    m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.math.exp2(m_i - m_sub)
    p = tl.math.exp2(scores - m_sub[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=0)


@triton.jit
def _partial_normalizer(m_i, l_i):
    """``(lse, 1 / l)`` of a finished partial; ``lse = -inf`` (and ``1 / l = 1``) if it saw no
    key."""
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.math.log2(safe_l), float("-inf"))
    return lse, 1.0 / safe_l


@triton.jit
def _window_value_part(
    v_window_ptr,
    rows,
    valid,
    rot_ptr,
    PART: tl.constexpr,
    ROTATED: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PC: tl.constexpr,
    PC_PAD: tl.constexpr,
):
    """Part ``PART`` (elements ``PART * PC + j``) of ring values, transposed ``[PC_PAD,
    BLOCK_W]``, in the space of the value accumulators: rotated (``(v @ R)^T / sqrt(D)``,
    float32) for rotated values, else as stored."""
    j = tl.arange(0, PC_PAD)[:, None]
    if ROTATED:
        d = tl.arange(0, D_PAD)[:, None]
        v_t = tl.load(v_window_ptr + rows[None, :] + d, mask=valid[None, :] & (d < D), other=0.0)
        i = tl.arange(0, D_PAD)[None, :]
        rot_t = tl.load(rot_ptr + i * D + PART * PC + j, mask=(i < D) & (j < PC), other=0.0)
        part = tl.dot(rot_t, v_t.to(tl.float32), input_precision="tf32") * INV_SQRT_D
    else:
        part = tl.load(v_window_ptr + rows[None, :] + PART * PC + j,
                       mask=valid[None, :] & (j < PC), other=0.0)  # fmt: skip
    return part


@triton.jit
def _split_kernel(
    q_ptr,
    q_orig_ptr,
    stride_qb,
    stride_qh,
    q_scale,
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
    rot_ptr,
    mask_ptr,
    stride_mask_b,
    stride_mask_h,
    mask_len,
    k_window_ptr,
    v_window_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    window,
    part_out_ptr,
    part_lse_ptr,
    num_kv_heads,
    max_pages,
    MASK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WINDOW_QK_F32: tl.constexpr,
    WINDOW_F32: tl.constexpr,
    V_ROTATED: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
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
):
    split = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)

    # This split's token range of the compressed positions [0, len - W), from the device-side
    # length: [start, end). The window's min(len, W) ring tokens count as work too, and go to
    # the split whose range the compressed positions end in (after its compressed tiles).
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_pages * PAGE_SIZE + window)
    window_len = tl.minimum(seq_len, window)
    compressed_len = seq_len - window_len
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, compressed_len)

    # The GQA group's prepared queries, transposed: fp16 [K_PC_PAD, G_PAD] per part, the B
    # operands of S^T = K @ Q^T (columns >= GROUP: 0). Tokens are the M dimension of both
    # products, so the group is padded to the tensor cores' N = 8, not to M = 16.
    g = tl.arange(0, G_PAD)
    row_ok = g < GROUP
    q_head = head * GROUP + g
    q_rows = (b * num_kv_heads * GROUP + q_head).to(tl.int64)
    q_part = q_ptr + q_rows[:, None] * (K_PARTS * K_PC_PAD) + tl.arange(0, K_PC_PAD)[None, :]
    q0 = tl.trans(tl.load(q_part, mask=row_ok[:, None], other=0.0))
    q1 = tl.trans(tl.load(q_part + K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 1), other=0.0))
    q2 = tl.trans(tl.load(q_part + 2 * K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 2), other=0.0))
    q3 = tl.trans(tl.load(q_part + 3 * K_PC_PAD, mask=row_ok[:, None] & (K_PARTS > 2), other=0.0))

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
    k_byte = tl.arange(0, K_PC_PAD)[None, :]
    v_byte = tl.arange(0, V_PC_PAD)[:, None]
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        valid = n < end
        page_ptr = block_table_ptr + b * stride_bt_b + (n // PAGE_SIZE) * stride_bt_p
        page = tl.load(page_ptr, mask=valid, other=0).to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        # Code rows are read unmasked (tokens past the end read their page, or page 0, and get
        # zero probability), so that the loads stay vectorized along the tokens.
        k0, k1, k2, k3 = _decode_tile(
            k_codes_ptr, (page * stride_kc_page + k_head + slot * stride_kc_slot)[:, None],
            k_byte, k_byte < K_PC, codebooks_ptr, K_KIND, K_BITS, D, K_OFF1, 1, 1, K_ASM,
        )  # fmt: skip
        scores = tl.dot(k0, q0)  # [BLOCK_N, G_PAD] fp32, log2 domain
        if K_PARTS > 1:
            scores = tl.dot(k1, q1, scores)
        if K_PARTS > 2:
            scores = tl.dot(k2, q2, scores)
            scores = tl.dot(k3, q3, scores)
        m_row = meta_ptr + page * stride_m_page + m_head + slot * stride_m_slot
        if K_KIND != _FP8:
            k_mul = tl.load(m_row + K_META, mask=valid, other=0.0).to(tl.float32)
            scores = scores * k_mul[:, None]
        scores = _mask_scores(scores, n, mask_ptr, b, q_head, row_ok, stride_mask_b,
                              stride_mask_h, mask_len, MASK)  # fmt: skip
        scores = tl.where(valid[:, None], scores, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)

        # fp8 bytes past the end could be NaN, which a zero probability does not cancel
        v_mask = v_byte < V_PC
        if (V_KIND == _FP8) | (V_KIND == _FP8_ABSMAX):
            v_mask = v_mask & valid[None, :]
        v0, v1, v2, v3 = _decode_tile(
            v_codes_ptr, (page * stride_vc_page + v_head + slot)[None, :], v_byte, v_mask,
            codebooks_ptr + CODEBOOK_STRIDE, V_KIND, V_BITS, D, V_OFF1, PAGE_SIZE, TOKEN_RUN,
            V_ASM,
        )  # fmt: skip
        v_mul = tl.load(m_row + V_META, mask=valid, other=0.0).to(tl.float32)
        if V_KIND == _UNIFORM:
            v_zero = tl.load(m_row + V_META + 1, mask=valid, other=0.0).to(tl.float32)
            zero_acc = zero_acc * alpha + tl.sum(p * v_zero[:, None], axis=0)
        pv = (p * v_mul[:, None]).to(tl.float16)
        acc0 = tl.dot(v0, pv, acc0 * alpha[None, :])
        if V_PARTS > 1:
            acc1 = tl.dot(v1, pv, acc1 * alpha[None, :])
        if V_PARTS > 2:
            acc2 = tl.dot(v2, pv, acc2 * alpha[None, :])
            acc3 = tl.dot(v3, pv, acc3 * alpha[None, :])

    if HAS_WINDOW:
        if (window_len > 0) & (split == compressed_len // per_split):
            # The ring: slot r holds the position of [len - window_len, len) that is r mod W.
            # S^T = K @ Q^T against the original (unrotated) query in the ring's dtype (tf32,
            # exact for 16-bit inputs, when the query's dtype differs), P @ V in fp16 like the
            # compressed tiles, float32 accumulation; all float32 under the interpreter, which
            # cannot run 16-bit dots.
            d = tl.arange(0, D_PAD)
            q_ptrs = q_orig_ptr + b.to(tl.int64) * stride_qb + q_head[None, :] * stride_qh
            q_orig = tl.load(q_ptrs + d[:, None], mask=row_ok[None, :] & (d < D)[:, None],
                             other=0.0)  # fmt: skip
            if WINDOW_QK_F32:
                q_orig = q_orig.to(tl.float32)
            first = compressed_len  # position of the oldest window token
            ring = b.to(tl.int64) * stride_w_b + head.to(tl.int64) * stride_w_h
            for r0 in range(0, window_len, BLOCK_W):
                r = r0 + tl.arange(0, BLOCK_W)
                in_window = r < window_len
                positions = first + (r + window - first % window) % window
                rows = ring + r.to(tl.int64) * stride_w_slot
                k = tl.load(k_window_ptr + rows[:, None] + d[None, :],
                            mask=in_window[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
                scores = tl.dot(k.to(q_orig.dtype), q_orig)
                scores = _mask_scores(scores * q_scale, positions, mask_ptr, b, q_head, row_ok,
                                      stride_mask_b, stride_mask_h, mask_len, MASK)  # fmt: skip
                scores = tl.where(in_window[:, None], scores, float("-inf"))
                p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)
                zero_acc = zero_acc * alpha
                if WINDOW_F32:
                    pv = p
                else:
                    pv = p.to(tl.float16)
                v0 = _window_value_part(v_window_ptr, rows, in_window, rot_ptr, 0, V_ROTATED,
                                        D, D_PAD, INV_SQRT_D, V_PC, V_PC_PAD)  # fmt: skip
                acc0 = tl.dot(v0.to(pv.dtype), pv, acc0 * alpha[None, :])
                if V_PARTS > 1:
                    v1 = _window_value_part(v_window_ptr, rows, in_window, rot_ptr, 1,
                                            V_ROTATED, D, D_PAD, INV_SQRT_D, V_PC,
                                            V_PC_PAD)  # fmt: skip
                    acc1 = tl.dot(v1.to(pv.dtype), pv, acc1 * alpha[None, :])
                if V_PARTS > 2:
                    v2 = _window_value_part(v_window_ptr, rows, in_window, rot_ptr, 2,
                                            V_ROTATED, D, D_PAD, INV_SQRT_D, V_PC,
                                            V_PC_PAD)  # fmt: skip
                    acc2 = tl.dot(v2.to(pv.dtype), pv, acc2 * alpha[None, :])
                    v3 = _window_value_part(v_window_ptr, rows, in_window, rot_ptr, 3,
                                            V_ROTATED, D, D_PAD, INV_SQRT_D, V_PC,
                                            V_PC_PAD)  # fmt: skip
                    acc3 = tl.dot(v3.to(pv.dtype), pv, acc3 * alpha[None, :])

    # This split's partial, normalized, in natural element order; lse in the log2 domain.
    lse, inv_l = _partial_normalizer(m_i, l_i)
    part_rows = q_rows * NUM_SPLITS + split
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
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    NUM_SPLITS: tl.constexpr,
    ROTATE_BACK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """``out[row] = sum_s w_s * o_s / sum_s w_s`` with ``w_s = exp2(lse_s - max lse)``."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s)
    m = tl.max(lse, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m), 0.0)
    total = tl.sum(w, axis=0)
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s)[:, None] * D + d[None, :],
        mask=(d < D)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    if ROTATE_BACK:
        # x = y @ R.T / sqrt(D): out[j] = sum_i y[i] * R[j, i].
        rot_mask = (d[:, None] < D) & (d < D)[None, :]
        rot = tl.load(rot_ptr + d[None, :] * D + d[:, None], mask=rot_mask, other=0.0)
        out = tl.sum(out[:, None] * rot, axis=0) * INV_SQRT_D
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


# Programs of the split kernel per SM that the default split count aims at (each holds
# DEFAULT_WARPS warps), and the fewest tokens worth a split of its own.
_PROGRAMS_PER_SM = 8
_MIN_SPLIT_TOKENS = 128


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """A fixed split count for a cache: about ``_PROGRAMS_PER_SM`` programs per SM, at least
    ``_MIN_SPLIT_TOKENS`` tokens per split.

    Chosen once from the cache's capacity (``batch`` x ``max_seq_len``) and the GPU's SM count,
    never from the current lengths, so a captured graph stays valid as sequences grow.
    """
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count, max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // _MIN_SPLIT_TOKENS)
    return min(1024, triton.next_power_of_2(max(1, min(wanted, by_length))))


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
    mask=None,
    scale=1.0,
    k_window=None,
    v_window=None,
):
    """Buffers ``(q_code, part_out, part_lse)`` and the grid, positional and keyword arguments of
    ``_split_kernel`` for query ``q [B, Hq, D]``."""
    has_window = k_window is not None
    q_code, part_out, part_lse = _buffers(fmt, q, num_splits)
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    group = num_q_heads // num_kv_heads
    grid = (num_splits, num_kv_heads, batch)
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
    if has_window:
        window_args = (k_window, v_window, *k_window.stride()[:3], k_window.shape[2])
    else:
        window_args = (q, q, 0, 0, 0, 0)  # never read; window 0: every position is compressed
    args = (
        q_code, q, q.stride(0), q.stride(1), scale * LOG2E, cache.k_codes, cache.v_codes,
        cache.meta, *cache.k_codes.stride()[:3], *cache.v_codes.stride()[:2],
        *cache.meta.stride()[:3], block_table, *block_table.stride(), seq_lens, codebooks,
        rotation, *mask_args, *window_args, part_out, part_lse, num_kv_heads, block_table.shape[1],
    )  # fmt: skip
    kwargs = dict(
        MASK=mask_kind,
        PAGE_SIZE=page_size,
        TOKEN_RUN=_token_run(page_size, block_n),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        GROUP=group,
        G_PAD=triton.next_power_of_2(group),
        BLOCK_N=block_n,
        BLOCK_W=_BLOCK_W,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=has_window,
        WINDOW_QK_F32=not fast or (has_window and k_window.dtype != q.dtype),
        WINDOW_F32=not fast,
        V_ROTATED=fmt.value.rotated,
        INV_SQRT_D=1.0 / math.sqrt(head_dim),
        **_side_constexprs("K", fmt, "k", head_dim),
        **_side_constexprs("V", fmt, "v", head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        K_ASM=decode_asm(fmt.key, head_dim) if fast else "",
        V_ASM=decode_asm(fmt.value, head_dim) if fast else "",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return (q_code, part_out, part_lse), grid, args, kwargs


_REGISTERS_PER_SM = 65536
_register_caps: dict = {}


def _window_register_cap(grid, args, kwargs) -> int:
    """``maxnreg`` for the split kernel with a window: the most registers that keep the
    occupancy (programs per SM) of the same kernel without one, which is compiled once per
    configuration to read its register count.

    Without a cap, the window's tiles raise the kernel's registers, and fewer programs per SM
    stream the compressed tiles; with it, ptxas fits the window in the streaming loop's budget.
    """
    key = (args[0].device, tuple(sorted(kwargs.items())))
    if key not in _register_caps:
        plain = _split_kernel.warmup(*args, grid=grid, **{**kwargs, "HAS_WINDOW": False})
        plain._init_handles()
        threads = 32 * kwargs["num_warps"]
        programs = max(1, _REGISTERS_PER_SM // (threads * plain.n_regs))
        # registers are allocated per thread in multiples of 8, at most 255
        _register_caps[key] = min(255, _REGISTERS_PER_SM // (threads * programs) // 8 * 8)
    return _register_caps[key]


def _buffers(fmt, q, num_splits):
    batch, num_q_heads, head_dim = q.shape
    parts, _, chunk_pad = _part_params(fmt.key, head_dim)
    q_code = torch.empty(
        batch, num_q_heads, parts * chunk_pad, dtype=torch.float16, device=q.device
    )
    part_out = torch.empty(
        batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
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
    block_n: int = DEFAULT_BLOCK_N,
    fast: bool | None = None,
    num_warps: int = DEFAULT_WARPS,
    num_stages: int = DEFAULT_STAGES,
) -> torch.Tensor:
    """Launch the decode kernels (inputs validated; see ``torch.ops.tq.decode``).

    ``fast`` selects the inline-PTX decoding (default: on CUDA; the interpreter cannot run it).
    ``block_n``, ``num_warps`` and ``num_stages`` tune the split kernel (see NOTES.md).
    """
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    fast = q.device.type == "cuda" if fast is None else fast
    (q_code, part_out, part_lse), grid, args, kwargs = _split_launch(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, block_n, fast,
        num_warps, num_stages, mask, scale, k_window, v_window,
    )  # fmt: skip
    parts, chunk, chunk_pad = _part_params(fmt.key, head_dim)
    inv_sqrt_d = 1.0 / math.sqrt(head_dim)
    d_pad = triton.next_power_of_2(head_dim)
    _prep_query_kernel[(batch * num_q_heads,)](
        q, q.stride(0), q.stride(1), rotation, q_code, num_q_heads, scale * LOG2E,
        ROTATE=fmt.key.rotated, D=head_dim, D_PAD=d_pad, INV_SQRT_D=inv_sqrt_d,
        PARTS=parts, PC=chunk, PC_PAD=chunk_pad,
    )  # fmt: skip
    if k_window is not None and fast:
        kwargs["maxnreg"] = _window_register_cap(grid, args, kwargs)
    _split_kernel[grid](*args, **kwargs)
    _merge_kernel[(batch * num_q_heads,)](
        part_out, part_lse, rotation, out, NUM_SPLITS=num_splits,
        ROTATE_BACK=fmt.value.rotated, D=head_dim, D_PAD=d_pad, INV_SQRT_D=inv_sqrt_d,
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
    k_window=None,
    v_window=None,
):
    """Compile (not launch) the split kernel for these inputs through ``compile_fn(kernel, grid,
    *args, **kwargs)``; used by ``benchmarks/sass_report.py`` to inspect its SASS."""
    _, grid, args, kwargs = _split_launch(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, block_n, fast,
        num_warps, num_stages, k_window=k_window, v_window=v_window,
    )  # fmt: skip
    return compile_fn(_split_kernel, grid, *args, **kwargs)
