"""The prefill kernel: a chunk's attention over its sequence's cached prefix, merged into the
chunk's own attention.

``tq.prefill`` first runs dense SDPA over the chunk's exact keys and values (cuDNN, with its
log-sum-exp: :mod:`custom_ops.sdpa_lse`); this kernel then finishes each query row in place.
One program serves ``BLOCK_M`` query rows of one (sequence, kv-head): rows ``r = t * GROUP +
g`` (token ``t`` of the chunk, query head ``kv_head * GROUP + g``), so each cache byte it reads
serves the whole GQA group of ``BLOCK_M / GROUP`` tokens. Its online softmax (log2 domain)
visits, in this order:

1. the compressed prefix, positions ``[SINKS, min(start, ring_start))`` (``start`` = the chunk's
   first position), ``BLOCK_N`` tokens a tile read through the block table: key codes decoded
   to fp16 parts (:func:`~custom_ops.triton.decode.codes.decode_tile`, the decode kernels' own
   dequantization) against the query rotated into the code space, value codes against the
   probabilities times the values' scale, relative to the tile's largest so that fp16 holds
   them; then the accumulator goes back to the original space (rotated values) in one product;
2. the prefix's positions in the ring (the sinks, and a ring run that the chunk did not push
   out), in full precision;
3. the chunk: the SDPA result and its log-sum-exp, merged, where SDPA computed what this row
   must see (see ``CHUNK_MODE``); otherwise the chunk's exact keys and values tile by tile.

Keys stored centred get ``q . centre`` back on their scores (the chunk's keys are not centred).
Visibility follows ``tq.prefill``: an optional mask row per token (bool, or additive), and
SDPA's top-left causal order when ``IS_CAUSAL``, and never past ``min(len, view_len)``.
A program whose rows SDPA already answered and whose prefix is empty writes nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.decode.codes import decode_tile
from custom_ops.triton.decode.softmax import LOG2E, softmax_rescale
from custom_ops.triton.decode.tiles import table_entries
from custom_ops.triton.kinds import LLOYD_MAX, UNIFORM
from custom_ops.triton.paged import ring_start
from custom_ops.triton.prefill.causal_rows import CAUSAL_OVER_CHUNK

__all__ = ["prefill_kernel", "CHUNK_FULL", "CHUNK_CAUSAL", "CHUNK_MASKED"]

_LOG2E = tl.constexpr(LOG2E)
_CAUSAL = tl.constexpr(CAUSAL_OVER_CHUNK)
# The lowest additive mask value taken as it is: times log2(e) it stays a finite float32.
_FLOOR = tl.constexpr(-2.0e38)
# What the chunk's SDPA result holds, and when a row may take it (CHUNK_MODE):
CHUNK_FULL = 0  # SDPA without a causal order, no mask: every row
CHUNK_CAUSAL = 1  # is_causal: only when start is 0 (SDPA's top-left order is then the chunk's)
CHUNK_MASKED = 2  # SDPA causal, a mask given: rows the mask check found causal over the chunk


# The widest original space one product with the rotation takes whole: at head dim 256 the
# float32 blocks (up to [256, 256], 256 KB) and their operands do not fit in shared memory, so
# the products go in quarters of the original space (queries) or of the code space (values).
_WHOLE_D_PAD = tl.constexpr(128)


@triton.jit
def _part_basis(
    rot_ptr,
    part,
    P: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    ROW0: tl.constexpr = 0,
    ROWS: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
    COLS: tl.constexpr = 0,
):
    """``[ROWS, COLS] float32`` (default ``[D_PAD, PC_PAD]``) from row ``ROW0`` and column
    ``COL0`` of the part basis: column ``c`` is code-space element ``part * PC + c`` of the
    codec ``P`` written in the original space (a column of ``R / sqrt(D)`` for rotated codes,
    of the identity otherwise); zero at padding. ``x @ basis`` takes a part of a vector into the
    code space, ``part @ basis^T`` brings it back."""
    NUM_ROWS: tl.constexpr = D_PAD if ROWS == 0 else ROWS
    NUM_COLS: tl.constexpr = P.PC_PAD if COLS == 0 else COLS
    e = ROW0 + tl.arange(0, NUM_ROWS)[:, None]
    c = COL0 + tl.arange(0, NUM_COLS)[None, :]
    element = part * P.PC + c
    ok = (e < D) & (c < P.PC)
    if P.KIND == LLOYD_MAX:
        return tl.load(rot_ptr + e * D + element, mask=ok, other=0.0) * INV_SQRT_D
    return tl.where(ok & (e == element), 1.0, 0.0)


@triton.jit
def _quarters(x):
    """``x [M, N]`` as its four column blocks ``[M, N / 4]``, in order."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    left, right = tl.split(tl.permute(tl.reshape(x, (M, 2, N // 2)), (0, 2, 1)))
    a, b = tl.split(tl.permute(tl.reshape(left, (M, 2, N // 4)), (0, 2, 1)))
    c, d = tl.split(tl.permute(tl.reshape(right, (M, 2, N // 4)), (0, 2, 1)))
    return a, b, c, d


@triton.jit
def _code_query(
    q,
    rot_ptr,
    part,
    P: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Query rows ``q [M, D_PAD] float32`` (already scaled to log2 units) in part ``part`` of the
    keys' code space, as the fp16 ``tl.dot`` operand ``[M, PC_PAD]``."""
    WHOLE: tl.constexpr = D_PAD <= _WHOLE_D_PAD
    if WHOLE:
        coded = tl.dot(
            q, _part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D), input_precision="ieee"
        )
    else:  # a quarter of the original space at a time: [M, D_PAD / 4] x [D_PAD / 4, PC_PAD]
        Q: tl.constexpr = D_PAD // 4
        q0, q1, q2, q3 = _quarters(q)
        coded = tl.dot(
            q0, _part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 0, Q), input_precision="ieee"
        )
        coded = tl.dot(
            q1,
            _part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, Q, Q),
            coded,
            input_precision="ieee",
        )
        coded = tl.dot(
            q2,
            _part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 2 * Q, Q),
            coded,
            input_precision="ieee",
        )
        coded = tl.dot(
            q3,
            _part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 3 * Q, Q),
            coded,
            input_precision="ieee",
        )
    return coded.to(tl.float16)


@triton.jit
def _to_original(
    acc,
    part,
    rot_ptr,
    P: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """An accumulator part ``[M, PC_PAD]`` of the values' code space as ``[M, D_PAD]`` in the
    original space."""
    WHOLE: tl.constexpr = (D_PAD <= _WHOLE_D_PAD) | (P.PC_PAD <= 64)  # a block of <= 64 KB
    if WHOLE:
        out = tl.dot(
            acc,
            tl.trans(_part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D)),
            input_precision="ieee",
        )
    else:  # a quarter of the code space at a time: [M, PC_PAD / 4] x [PC_PAD / 4, D_PAD]
        C: tl.constexpr = P.PC_PAD // 4
        a0, a1, a2, a3 = _quarters(acc)
        out = tl.dot(
            a0,
            tl.trans(_part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 0, 0, 0, C)),
            input_precision="ieee",
        )
        out = tl.dot(
            a1,
            tl.trans(_part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 0, 0, C, C)),
            out,
            input_precision="ieee",
        )
        out = tl.dot(
            a2,
            tl.trans(_part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 0, 0, 2 * C, C)),
            out,
            input_precision="ieee",
        )
        out = tl.dot(
            a3,
            tl.trans(_part_basis(rot_ptr, part, P, D, D_PAD, INV_SQRT_D, 0, 0, 3 * C, C)),
            out,
            input_precision="ieee",
        )
    return out


@triton.jit
def _bias(
    positions, t, heads, b, row_ok, limit, mask_args, MASK: tl.constexpr, IS_CAUSAL: tl.constexpr
):
    """Additive bias ``[M, N]`` (log2 units: 0 visible, -inf hidden, or an additive mask) of
    key ``positions [N]`` for query rows of tokens ``t [M]`` and query heads ``heads [M]``:
    positions at or past ``limit`` are hidden, and so are those after the row's token in the
    top-left causal order when ``IS_CAUSAL``, and those the mask hides (``MASK`` 1 bool, 2
    additive; ``mask_args = (mask_ptr, stride_b, stride_h, stride_t, mask_len)``)."""
    shown = row_ok[:, None] & ((positions >= 0) & (positions < limit))[None, :]
    if IS_CAUSAL:
        shown = shown & (positions[None, :] <= t[:, None])
    if MASK == 0:
        return tl.where(shown, 0.0, float("-inf"))
    mask_ptr, stride_mb, stride_mh, stride_mt, mask_len = mask_args
    rows = b.to(tl.int64) * stride_mb + heads * stride_mh + t.to(tl.int64) * stride_mt
    loaded = shown & (positions < mask_len)[None, :]
    m = tl.load(mask_ptr + rows[:, None] + positions[None, :], mask=loaded, other=0)
    if MASK == 1:
        return tl.where(loaded & (m != 0), 0.0, float("-inf"))
    # a finite "minus infinity" (finfo.min) would overflow float32 times log2(e): kept finite
    bias = tl.maximum(m.to(tl.float32), _FLOOR) * _LOG2E
    return tl.where(loaded & (m != float("-inf")), bias, float("-inf"))


@triton.jit
def _exact_tile(
    q, k_rows, v_rows, ok, bias, m_i, l_i, acc, qk_scale, D: tl.constexpr, D_PAD: tl.constexpr
):
    """One tile of keys and values in full precision (rows at ``k_rows``, ``v_rows [N]``
    pointers, read where ``ok``) into the softmax state ``(m_i, l_i, acc [M, D_PAD])``; ``q
    [M, D_PAD]`` in the keys' dtype, ``bias [M, N]`` (log2 units; it already hides what is
    not ``ok``)."""
    e = tl.arange(0, D_PAD)[None, :]
    k = tl.load(k_rows[:, None] + e, mask=ok[:, None] & (e < D), other=0.0)
    scores = tl.dot(q, tl.trans(k)) * qk_scale + bias
    m_new, m_sub, alpha = softmax_rescale(tl.max(scores, axis=1), m_i)
    p = tl.math.exp2(scores - m_sub[:, None])
    v = tl.load(v_rows[:, None] + e, mask=ok[:, None] & (e < D), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def prefill_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    key_ptr,
    value_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_ot,
    lse_ptr,
    stride_lb,
    stride_lh,
    stride_lt,
    planes,
    table,
    seq_lens_ptr,
    rot_ptr,
    rings,
    center_ptr,
    mask_args,
    flags_ptr,
    stride_fb,
    stride_fh,
    num_kv_heads,
    tokens,
    window,
    max_pages,
    view_len,
    qk_scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    SINKS: tl.constexpr,
    HAS_RINGS: tl.constexpr,
    HAS_CENTER: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    CHUNK_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    batch_head = tl.program_id(0)
    b = batch_head // num_kv_heads
    kv_head = (batch_head % num_kv_heads).to(tl.int64)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < tokens * GROUP
    t = tl.where(row_ok, r // GROUP, 0)
    heads = kv_head * GROUP + r % GROUP
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_pages * PAGE_SIZE + window)
    start = tl.maximum(seq_len - tokens, 0)
    prefix_end = tl.minimum(start, view_len)
    chunk_end = tl.minimum(seq_len, view_len)

    # Whether the chunk's SDPA result is what every row of this program must see of the chunk.
    if CHUNK_MODE == 0:
        from_sdpa = start + tokens <= view_len
    elif CHUNK_MODE == 1:
        from_sdpa = (start == 0) & (tokens <= view_len)
    else:
        flags = tl.load(flags_ptr + b * stride_fb + heads * stride_fh + t, mask=row_ok, other=1)
        causal = (flags & _CAUSAL).to(tl.int32)
        from_sdpa = (tl.min(causal, axis=0) > 0) & (start + tokens <= view_len)
        if IS_CAUSAL:  # the mask and the top-left order: the chunk's causal order at start 0
            from_sdpa = from_sdpa & (start == 0)
    if from_sdpa & (prefix_end == 0):
        return  # SDPA's rows are the answer: nothing to add

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads * stride_qh + t.to(tl.int64) * stride_qt
    e = tl.arange(0, D_PAD)[None, :]
    q = tl.load(q_rows[:, None] + e, mask=row_ok[:, None] & (e < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    q_centre = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_CENTER:  # stored keys are k - centre: their scores get q . centre back
        centre = tl.load(
            center_ptr + (b.to(tl.int64) * num_kv_heads + kv_head) * D + e, mask=e < D, other=0.0
        )
        q_centre = tl.sum(q.to(tl.float32) * centre, axis=1) * qk_scale

    # 1. The compressed prefix, in the values' code space (parts of PC_PAD elements).
    window_ptr, v_window_ptr, pos_ptr, stride_wb, stride_wh, stride_ws = rings
    ring_rows = b.to(tl.int64) * stride_wb + kv_head * stride_wh
    pages_end = prefix_end
    if HAS_RINGS:
        pages_end = tl.minimum(prefix_end, ring_start(pos_ptr + ring_rows // D, seq_len, window))
    (
        k_codes,
        v_codes,
        meta,
        kc_page,
        kc_head,
        kc_slot,
        vc_page,
        vc_head,
        _,
        m_page,
        m_head,
        m_slot,
    ) = planes
    q_scaled = q.to(tl.float32) * qk_scale
    q0 = _code_query(q_scaled, rot_ptr, 0, K, D, D_PAD, INV_SQRT_D)
    q1 = q0
    q2 = q0
    q3 = q0
    if K.PARTS > 1:
        q1 = _code_query(q_scaled, rot_ptr, 1, K, D, D_PAD, INV_SQRT_D)
    if K.PARTS > 2:
        q2 = _code_query(q_scaled, rot_ptr, 2, K, D, D_PAD, INV_SQRT_D)
        q3 = _code_query(q_scaled, rot_ptr, 3, K, D, D_PAD, INV_SQRT_D)
    V_PC_PAD: tl.constexpr = V.PC_PAD
    acc0 = tl.zeros((BLOCK_M, V_PC_PAD), tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    zero_acc = tl.zeros((BLOCK_M,), tl.float32)
    k_byte = tl.arange(0, K.PC_PAD)[None, :]
    v_byte = tl.arange(0, V.PC_PAD)[:, None]
    for n0 in range(0, pages_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_pages = n < pages_end
        valid = in_pages & (n >= SINKS)  # the sinks are read from the ring
        page = table_entries(n, in_pages, b, table, PAGE_SIZE).to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        k_row = page * kc_page + kv_head * kc_head + slot * kc_slot
        k0, k1, k2, k3 = decode_tile(k_codes, k_row[:, None], k_byte, k_byte < K.PC, K, D, 1, 1)
        scores = tl.dot(q0, tl.trans(k0))
        if K.PARTS > 1:
            scores = tl.dot(q1, tl.trans(k1), scores)
        if K.PARTS > 2:
            scores = tl.dot(q2, tl.trans(k2), scores)
            scores = tl.dot(q3, tl.trans(k3), scores)
        m_row = meta + page * m_page + kv_head * m_head + slot * m_slot
        k_mul = tl.load(m_row + K.META, mask=valid, other=0.0).to(tl.float32)
        scores = scores * k_mul[None, :] + q_centre[:, None]
        scores += _bias(n, t, heads, b, row_ok, prefix_end, mask_args, MASK, IS_CAUSAL)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new, m_sub, alpha = softmax_rescale(tl.max(scores, axis=1), m_i)
        p = tl.math.exp2(scores - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # values: p times each token's scale (or norm) relative to the tile's largest, in fp16
        v_mul = tl.load(m_row + V.META, mask=valid, other=0.0).to(tl.float32)
        unit = tl.max(tl.abs(v_mul), axis=0)
        unit = tl.where(unit > 0, unit, 1.0)
        pv = (p * (v_mul / unit)[None, :]).to(tl.float16)
        if V.KIND == UNIFORM:
            v_zero = tl.load(m_row + V.META + 1, mask=valid, other=0.0).to(tl.float32)
            zero_acc = zero_acc * alpha + tl.sum(p * v_zero[None, :], axis=1)
        v_row = page * vc_page + kv_head * vc_head + slot
        v0, v1, v2, v3 = decode_tile(
            v_codes, v_row[None, :], v_byte, v_byte < V.PC, V, D, PAGE_SIZE, TOKEN_RUN, FINITE=True
        )
        acc0 = acc0 * alpha[:, None] + tl.dot(pv, tl.trans(v0)) * unit
        if V.PARTS > 1:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, tl.trans(v1)) * unit
        if V.PARTS > 2:
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, tl.trans(v2)) * unit
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, tl.trans(v3)) * unit
    acc = _to_original(acc0, 0, rot_ptr, V, D, D_PAD, INV_SQRT_D)
    if V.PARTS > 1:
        acc += _to_original(acc1, 1, rot_ptr, V, D, D_PAD, INV_SQRT_D)
    if V.PARTS > 2:
        acc += _to_original(acc2, 2, rot_ptr, V, D, D_PAD, INV_SQRT_D)
        acc += _to_original(acc3, 3, rot_ptr, V, D, D_PAD, INV_SQRT_D)
    if V.KIND == UNIFORM:
        acc += tl.where(e < D, zero_acc[:, None], 0.0)

    # 2. The prefix's positions in the ring (sinks, and a run the chunk left there).
    if HAS_RINGS:
        for s0 in range(0, window + SINKS, BLOCK_N):
            s = s0 + tl.arange(0, BLOCK_N)
            held = tl.load(pos_ptr + ring_rows // D + s, mask=s < window + SINKS, other=-1)
            ok = (held >= 0) & (held < prefix_end)
            bias = _bias(held, t, heads, b, row_ok, prefix_end, mask_args, MASK, IS_CAUSAL)
            bias = tl.where(ok[None, :], bias + q_centre[:, None], float("-inf"))
            slots = ring_rows + s.to(tl.int64) * stride_ws
            m_i, l_i, acc = _exact_tile(
                q,
                window_ptr + slots,
                v_window_ptr + slots,
                ok,
                bias,
                m_i,
                l_i,
                acc,
                qk_scale,
                D,
                D_PAD,
            )

    # 3. The chunk: SDPA's rows and their log-sum-exp, or its exact keys and values.
    if from_sdpa:
        out_rows = b.to(tl.int64) * stride_ob + heads * stride_oh + t.to(tl.int64) * stride_ot
        chunk_out = tl.load(
            out_ptr + out_rows[:, None] + e, mask=row_ok[:, None] & (e < D), other=0.0
        ).to(tl.float32)
        lse_rows = b.to(tl.int64) * stride_lb + heads * stride_lh + t.to(tl.int64) * stride_lt
        chunk_lse = tl.load(lse_ptr + lse_rows, mask=row_ok, other=0.0) * _LOG2E
        m_new, m_sub, alpha = softmax_rescale(chunk_lse, m_i)
        beta = tl.math.exp2(chunk_lse - m_sub)
        acc = acc * alpha[:, None] + chunk_out * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    else:
        chunk_keys = key_ptr + b.to(tl.int64) * stride_kb + kv_head * stride_kh
        chunk_values = value_ptr + b.to(tl.int64) * stride_vb + kv_head * stride_vh
        for j0 in range(0, tokens, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            ok = j < tokens
            bias = _bias(start + j, t, heads, b, row_ok, chunk_end, mask_args, MASK, IS_CAUSAL)
            bias = tl.where(ok[None, :], bias, float("-inf"))
            if tl.max(tl.max(bias, axis=1), axis=0) > float("-inf"):  # a tile nobody sees
                m_i, l_i, acc = _exact_tile(
                    q,
                    chunk_keys + j.to(tl.int64) * stride_kt,
                    chunk_values + j.to(tl.int64) * stride_vt,
                    ok,
                    bias,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    D,
                    D_PAD,
                )

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)
    out_rows = b.to(tl.int64) * stride_ob + heads * stride_oh + t.to(tl.int64) * stride_ot
    tl.store(
        out_ptr + out_rows[:, None] + e,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (e < D),
    )
