"""One tile of the split kernel's loops: scores and value products of compressed tokens, and of
recent-window (ring) tokens in full precision.

Tokens are the tensor cores' M dimension: ``S^T = K @ Q^T`` (``[N, G_PAD]``) and ``O^T += V^T @
P^T`` (``[PC_PAD, G_PAD]`` per value part). Argument tuples name the planes a tile reads:
``table = (block_table_ptr, stride_b, stride_p)``, ``k_plane = (k_codes_ptr, head_offset,
stride_page, stride_slot)``, ``meta_plane = (meta_ptr, head_offset, stride_page,
stride_slot)``, ``v_plane = (v_codes_ptr, head_offset, stride_page)`` (value rows token-minor,
so a slot is a byte offset), ``qs = (q0, q1, q2, q3)`` the query parts, or with ``INT8_KEYS``
:func:`custom_ops.triton.decode.query.int8_query`'s ``(his, los, half_sum, step)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.decode.codes import decode_int8_keys, decode_tile
from custom_ops.triton.decode.softmax import lane_row_sums, mask_scores
from custom_ops.triton.kinds import UNIFORM

__all__ = [
    "head_planes",
    "table_entries",
    "tile_pages",
    "compressed_valid",
    "tile_scalars",
    "compressed_scores",
    "value_multipliers",
    "compressed_values",
    "ring_scores",
    "ring_values",
    "split_probabilities",
    "ring_product",
]


@triton.jit
def head_planes(planes, head):
    """``(k_plane, v_plane, meta_plane)`` of kv-head ``head`` (int64) from the kernel argument
    ``planes`` (:mod:`custom_ops.triton.paged`)."""
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
    return (
        (k_codes, head * kc_head, kc_page, kc_slot),
        (v_codes, head * vc_head, vc_page),
        (meta, head * m_head, m_page, m_slot),
    )


@triton.jit
def table_entries(n, ok, b, table, PAGE_SIZE: tl.constexpr):
    """The block-table entries (int32 page ids) of positions ``n [BLOCK_N]``, read where
    ``ok`` (0 elsewhere)."""
    block_table_ptr, stride_bt_b, stride_bt_p = table
    page_ptr = block_table_ptr + b * stride_bt_b + (n // PAGE_SIZE) * stride_bt_p
    return tl.load(page_ptr, mask=ok, other=0)


@triton.jit
def tile_pages(tile_start, end, b, table, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile of ``BLOCK_N`` positions from ``tile_start`` (a multiple of ``BLOCK_N``) within
    one page (``PAGE_SIZE`` a multiple of ``BLOCK_N``) or two (``BLOCK_N == 2 * PAGE_SIZE``):
    ``(first, second, offset)``, its page ids as int64 scalars (``second`` is ``first`` for one
    page; a page at or past ``end`` reads as 0) and its first slot in the first page (int32). Two
    scalar loads where the tile's ``[BLOCK_N]`` entries would be relaid through shared memory
    to the lanes' rows, each row then addressed on its own
    (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program). The verify kernel's
    ``verify._tile_pages`` reads the same one or two entries, selected per token."""
    block_table_ptr, stride_bt_b, stride_bt_p = table
    entry = block_table_ptr + b * stride_bt_b + (tile_start // PAGE_SIZE) * stride_bt_p
    first = tl.load(entry, mask=tile_start < end, other=0).to(tl.int64)
    second = first
    if BLOCK_N == 2 * PAGE_SIZE:
        second_ok = tile_start + PAGE_SIZE < end
        second = tl.load(entry + stride_bt_p, mask=second_ok, other=0).to(tl.int64)
    else:
        tl.static_assert(PAGE_SIZE % BLOCK_N == 0, "tile_pages: one page or two per tile")
    return first, second, tile_start % PAGE_SIZE


@triton.jit
def compressed_valid(n, end, ONE_TILE: tl.constexpr, SINKS: tl.constexpr):
    """Which positions ``n [BLOCK_N]`` are compressed tokens of the sequence: below ``end`` and
    not sinks (those are read from the ring)."""
    valid = n < end
    if SINKS > 0:
        if ONE_TILE:
            valid = valid & (n >= SINKS)
        else:
            # SINKS <= n < end as one unsigned compare (n - SINKS wraps below the sinks):
            # streaming splits then pay 0-3% for 4 sinks instead of up to 5%, a one-tile split
            # pays more that way (docs/design/decode.md#sinks-in-the-split-kernel)
            limit = (tl.maximum(end, SINKS) - SINKS).to(tl.uint32, bitcast=True)
            valid = (n - SINKS).to(tl.uint32, bitcast=True) < limit
    return valid


@triton.jit
def tile_scalars(
    n,
    end,
    b,
    table,
    meta_plane,
    PAGE_SIZE: tl.constexpr,
    SINKS: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
):
    """``(k_mul, v_mul, v_zero)``, the key and value scalars (float32 ``[BLOCK_N]``, 0 where not
    valid; ``v_zero`` 0 for values that are not uniform) of the compressed tokens at positions
    ``n`` of a streaming split, for the split kernel to load a tile before it uses them: 2-byte
    loads cannot go through ``cp.async``, so read in their own tile each is a DRAM round trip
    on that tile's chain (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program). The
    block-table entries are read again, per token (the codes' own come from the tile's own
    read, or from :func:`tile_pages`)."""
    valid = compressed_valid(n, end, False, SINKS)
    page = table_entries(n, n < end, b, table, PAGE_SIZE).to(tl.int64)
    m_row = meta_rows(meta_plane, page, (n % PAGE_SIZE).to(tl.int64))
    return (
        key_multipliers(m_row, valid, K),
        value_multipliers(m_row, valid, V),
        value_zeros(m_row, valid, V),
    )


@triton.jit
def compressed_scores(
    n,
    end,
    early,
    b,
    table,
    k_plane,
    meta_plane,
    qs,
    masking,
    q_head,
    row_ok,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    INT8_KEYS: tl.constexpr = False,
    k_mul=None,
    pages=None,
):
    """Scores ``S^T = K @ Q^T`` of the compressed tokens at positions ``n [BLOCK_N]`` (``-inf``
    at and past ``end``, and below ``SINKS``: the sinks are read from the ring), capped by
    ``SOFTCAP`` and masked (:func:`custom_ops.triton.decode.softmax.mask_scores`): ``(scores
    [BLOCK_N, G_PAD] float32 in log2 units, page, slot, meta row pointers, valid)``.
    ``INT8_KEYS``: 3-, 4- or 5-bit keys decoded to int8 against ``qs`` from
    :func:`~custom_ops.triton.decode.query.int8_query`, integer products.

    Page ids come from the block table, from ``early`` (entries read before the length was
    known, ``ONE_TILE``) or from ``pages`` (:func:`tile_pages`, scalars), kept only below
    ``end``: entries past a sequence's pages may hold anything and are never followed (with
    ``pages``, tokens past the end in the tile's first page read that page, the sequence's
    own). Code rows are read unmasked, so that the loads stay vectorized along the tokens:
    tokens past the end read their page (or page 0) and get zero probability (see
    :func:`compressed_values`). The sinks' entries are followed like any other
    (the table holds their pages, never written): a run of value codes is loaded from its first
    token's page, which may be a sink's. ``k_mul``: the key scalars if loaded ahead
    (:func:`tile_scalars`), else None (loaded here).
    """
    k_codes_ptr, k_head, stride_kc_page, stride_kc_slot = k_plane
    if pages is not None:
        # each row a page's base (two scalar products) plus a constant per lane
        first, second, offset = pages
        rows = tl.arange(0, n.shape[0])
        in_first = rows < PAGE_SIZE
        slot = (offset + rows % PAGE_SIZE).to(tl.int64)
        base = tl.where(in_first, first * stride_kc_page, second * stride_kc_page)
        k_rows = (base + k_head + slot * stride_kc_slot)[:, None]
        page = tl.where(in_first, first, second)
    else:
        if ONE_TILE:
            entries = tl.where(n < end, early, 0)
        else:
            entries = table_entries(n, n < end, b, table, PAGE_SIZE)
        page = entries.to(tl.int64)
        slot = (n % PAGE_SIZE).to(tl.int64)
        k_rows = (page * stride_kc_page + k_head + slot * stride_kc_slot)[:, None]
    valid = compressed_valid(n, end, ONE_TILE, SINKS)
    k_byte = tl.arange(0, K.PC_PAD)[None, :]
    if INT8_KEYS:
        # exact integer products (custom_ops.triton.decode.query.int8_query)
        his, los, half_sum, q_step = qs
        keys = decode_int8_keys(k_codes_ptr, k_rows, k_byte, k_byte < K.PC, K, D)
        high = tl.dot(keys[0], his[0], out_dtype=tl.int32)
        low = tl.dot(keys[0], los[0], out_dtype=tl.int32)
        PARTS: tl.constexpr = K.PARTS
        for part in tl.static_range(1, PARTS):
            high = tl.dot(keys[part], his[part], high, out_dtype=tl.int32)
            low = tl.dot(keys[part], los[part], low, out_dtype=tl.int32)
        # one FFMA per score: the half-sum term is scaled once per row, not added per score
        q_unit = q_step * (K.INT8_UNIT / 254.0)
        scores = (high * 254 + low).to(tl.float32) * q_unit[None, :] + (half_sum * q_unit)[None, :]
    else:
        q0, q1, q2, q3 = qs
        k0, k1, k2, k3 = decode_tile(k_codes_ptr, k_rows, k_byte, k_byte < K.PC, K, D, 1, 1)
        scores = tl.dot(k0, q0)
        if K.PARTS > 1:
            scores = tl.dot(k1, q1, scores)
        if K.PARTS > 2:
            scores = tl.dot(k2, q2, scores)
            scores = tl.dot(k3, q3, scores)
    m_row = meta_rows(meta_plane, page, slot)
    if k_mul is None:
        k_mul = key_multipliers(m_row, valid, K)
    scores = scores * k_mul[:, None]
    scores = mask_scores(scores, n, masking, b, q_head, row_ok, MASK, Q_TOKENS, SOFTCAP)
    return tl.where(valid[:, None], scores, float("-inf")), page, slot, m_row, valid


@triton.jit
def meta_rows(meta_plane, page, slot):
    """Pointers to the meta records of the tokens in page slots ``slot`` of pages ``page``
    (int64, ``[BLOCK_N]``)."""
    meta_ptr, m_head, stride_m_page, stride_m_slot = meta_plane
    return meta_ptr + page * stride_m_page + m_head + slot * stride_m_slot


@triton.jit
def key_multipliers(m_row, valid, K: tl.constexpr):
    """The key norm (or scale) of each token of a tile, ``[BLOCK_N] float32`` (0 where not
    ``valid``)."""
    return tl.load(m_row + K.META, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def value_zeros(m_row, valid, V: tl.constexpr):
    """The zero of each token's uniform values, ``[BLOCK_N] float32`` (0 where not ``valid``, and
    for values that are not uniform)."""
    if V.KIND == UNIFORM:
        return tl.load(m_row + V.META + 1, mask=valid, other=0.0).to(tl.float32)
    return tl.zeros(valid.shape, tl.float32)


@triton.jit
def value_multipliers(m_row, valid, V: tl.constexpr):
    """The value scale (or norm) of each token of a tile, ``[BLOCK_N] float32`` (0 where not
    ``valid``)."""
    return tl.load(m_row + V.META, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _value_codes(
    v_codes_ptr,
    rows,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    V: tl.constexpr,
    INTEGERS: tl.constexpr,
    BYTE_HALVES: tl.constexpr = False,
    SUBNORMAL: tl.constexpr = False,
):
    """The value parts (fp16 ``[PC_PAD, N]``, before the scalars; ``SUBNORMAL``: in the units
    of :func:`~custom_ops.triton.decode.codes.subnormal_part_scale`) of the code rows starting
    at ``rows [1, N]``. ``BYTE_HALVES``: the plane's bytes loaded and decoded as a ``[2, PC_PAD /
    2, N]`` tile (half ``h``'s byte ``b`` is byte ``h * PC_PAD / 2 + b``), then reshaped (see
    :func:`compressed_values`; stacking two ``[PC_PAD / 2, N]`` tiles with ``tl.join``
    compiled to wrong values on the H200 with Triton 3.6, right in the interpreter)."""
    N: tl.constexpr = rows.shape[1]
    if BYTE_HALVES:
        tl.static_assert(V.PC == V.PC_PAD, "byte halves: parts of a power of two")
        HALF_BYTES: tl.constexpr = V.PC_PAD // 2
        v_byte = (
            tl.arange(0, 2)[:, None, None] * HALF_BYTES + tl.arange(0, HALF_BYTES)[None, :, None]
        )
        rows = rows[None, :, :]
    else:
        v_byte = tl.arange(0, V.PC_PAD)[:, None]
    parts = decode_tile(
        v_codes_ptr,
        rows,
        v_byte,
        v_byte < V.PC,
        V,
        D,
        PAGE_SIZE,
        TOKEN_RUN,
        FINITE=True,
        INTEGERS=INTEGERS,
        SUBNORMAL=SUBNORMAL,
    )
    if BYTE_HALVES:
        parts = (
            tl.reshape(parts[0], [V.PC_PAD, N]),
            tl.reshape(parts[1], [V.PC_PAD, N]),
            tl.reshape(parts[2], [V.PC_PAD, N]),
            tl.reshape(parts[3], [V.PC_PAD, N]),
        )
    return parts


@triton.jit
def _value_products(parts, pv, acc0, acc1, acc2, acc3, V: tl.constexpr):
    """``acc_i += parts[i] @ pv`` for the value parts in use (``pv [N, G_PAD]`` fp16)."""
    v0, v1, v2, v3 = parts
    acc0 = tl.dot(v0, pv, acc0)
    if V.PARTS > 1:
        acc1 = tl.dot(v1, pv, acc1)
    if V.PARTS > 2:
        acc2 = tl.dot(v2, pv, acc2)
        acc3 = tl.dot(v3, pv, acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _page_value_products(
    v_codes_ptr,
    page_rows,
    pv,
    acc0,
    acc1,
    acc2,
    acc3,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    V: tl.constexpr,
    INTEGERS: tl.constexpr,
    SUBNORMAL: tl.constexpr,
):
    """:func:`_value_products` of one page's value codes, a tile of their own (code rows
    ``page_rows [PAGE_SIZE, 1]``, ``pv [PAGE_SIZE, G_PAD]``; see :func:`compressed_values`)."""
    # Triton 3.6 would send a [32, 16] tile of one warp through registers and shared memory
    BYTE_HALVES: tl.constexpr = V.PC_PAD == 32
    parts = _value_codes(
        v_codes_ptr,
        tl.reshape(page_rows, [1, PAGE_SIZE]),
        PAGE_SIZE,
        PAGE_SIZE,
        D,
        V,
        INTEGERS,
        BYTE_HALVES,
        SUBNORMAL,
    )
    return _value_products(parts, pv, acc0, acc1, acc2, acc3, V)


@triton.jit
def _page_halves(x, PAGE_SIZE: tl.constexpr):
    """The first and the second page's rows of ``x [2 * PAGE_SIZE, C]``: two ``[PAGE_SIZE,
    C]``."""
    C: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [2, PAGE_SIZE, C]), (1, 2, 0)))


@triton.jit
def compressed_values(
    p,
    v_mul,
    inv_unit,
    page,
    slot,
    m_row,
    valid,
    acc0,
    acc1,
    acc2,
    acc3,
    zero_rows,
    v_plane,
    PAGE_SIZE: tl.constexpr,
    TOKEN_RUN: tl.constexpr,
    D: tl.constexpr,
    V: tl.constexpr,
    INTEGERS: tl.constexpr = False,
    v_zero=None,
    VALUE_PAGES: tl.constexpr = False,
    SUBNORMAL: tl.constexpr = False,
    pages=None,
):
    """Add one tile's ``O^T += V^T @ (p * v_rel)^T`` per value part (``p [BLOCK_N, G_PAD]``;
    ``v_rel = v_mul * inv_unit``, the tokens' value multipliers ``v_mul [BLOCK_N]`` relative to
    the accumulators' unit, which the split kernel keeps within ``[2**-10, 2**11]`` (``p <=
    2**4``), so that the fp16 products neither overflow nor flush to zero whatever the values'
    magnitude), and ``sum(p * v_zero)`` (absolute) to ``zero_rows`` for uniform values
    (``v_zero``: their zeros if loaded ahead, :func:`tile_scalars`; None: loaded here), whose
    ``[8, G_PAD]`` rows are each lane's share of that sum
    (:func:`~custom_ops.triton.decode.softmax.lane_row_sums`).

    ``INTEGERS`` (3-bit Lloyd-Max values, ``V.INTEGER_SCALE``): the values enter as the grid's
    integers ``k / S`` (:func:`~custom_ops.triton.decode.codes.decode_tile`'s ``INTEGERS``:
    fewer instructions than their levels), the multipliers take ``unit * S`` (1 to 1.75, the
    unit's 3 significant bits: ``p * v_rel`` times it stays below 1.75 * 2**15, within fp16's
    range) and each level's ``unit / 2`` goes to ``zero_rows`` as ``v_zero = v_mul * unit /
    2``. ``SUBNORMAL`` (3- and 4-bit uniform values): the codes enter as fp16 subnormals, and
    part ``i``'s accumulator is in units of ``1 /`` its
    :func:`~custom_ops.triton.decode.codes.subnormal_part_scale` until the caller scales it
    back (``zero_rows`` stays absolute).

    ``VALUE_PAGES`` (a tile of two whole pages, ``BLOCK_N == 2 * PAGE_SIZE == 2 * TOKEN_RUN``):
    each page's value codes are loaded and multiplied as a tile of their own, so that the
    ``cp.async`` of 32 lanes reads 32 consecutive 16-byte rows of one page; a two-page tile has
    each lane's neighbour in the other page, and every lane's 16 bytes then cost a sector and
    a shared-memory wavefront of their own. Where a token's part is 32 bytes, a page's
    ``[32, PAGE_SIZE]`` codes load as a ``[2, 16, PAGE_SIZE]`` tile (the bytes in two halves),
    which Triton pipelines and decodes in the dot operand's layout where it does neither for a
    ``[32, 16]`` tile in one warp
    (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program). ``pages``: the tile's page
    ids as scalars (:func:`tile_pages`), which address each page's rows as a base plus
    consecutive slots.

    Value codes of tokens past the end enter the product with zero probability, which is only
    safe for codes that decode to finite numbers: fp8 bytes there (stale or never written) can
    be NaN, so fp8 values are decoded ``FINITE``.
    """
    v_codes_ptr, v_head, stride_vc_page = v_plane
    if not (VALUE_PAGES and pages is not None):  # else each page's rows from its id, below
        rows = page * stride_vc_page + v_head + slot
    if not VALUE_PAGES:
        parts = _value_codes(
            v_codes_ptr, rows[None, :], PAGE_SIZE, TOKEN_RUN, D, V, INTEGERS, False, SUBNORMAL
        )
    v_rel = v_mul * inv_unit
    if V.KIND == UNIFORM:
        if v_zero is None:
            v_zero = value_zeros(m_row, valid, V)
        zero_rows += lane_row_sums(p * v_zero[:, None])
    if INTEGERS:
        zero_rows += lane_row_sums(p * (v_mul * (V.INT8_UNIT * 0.5))[:, None])
        v_rel = v_rel * (V.INT8_UNIT * V.INTEGER_SCALE)
    pv = (p * v_rel[:, None]).to(tl.float16)
    if VALUE_PAGES:
        tl.static_assert(
            p.shape[0] == 2 * PAGE_SIZE and TOKEN_RUN == PAGE_SIZE and PAGE_SIZE >= 16,
            "value pages: a tile of two whole pages of at least 16 tokens (K >= 16)",
        )
        if pages is not None:
            # each page's rows a base plus consecutive slots (tile_pages)
            in_page = tl.arange(0, PAGE_SIZE)[:, None]
            rows_a = pages[0] * stride_vc_page + v_head + in_page
            rows_b = pages[1] * stride_vc_page + v_head + in_page
        else:
            rows_a, rows_b = _page_halves(rows[:, None], PAGE_SIZE)
        pv_a, pv_b = _page_halves(pv, PAGE_SIZE)
        # the first page's products before the second page's codes are decoded (tq4_nc's
        # loop: 893 SASS instructions and no spills, against 928 and 136 bytes of stack)
        acc0, acc1, acc2, acc3 = _page_value_products(
            v_codes_ptr, rows_a, pv_a, acc0, acc1, acc2, acc3, PAGE_SIZE, D, V, INTEGERS, SUBNORMAL
        )
        acc0, acc1, acc2, acc3 = _page_value_products(
            v_codes_ptr, rows_b, pv_b, acc0, acc1, acc2, acc3, PAGE_SIZE, D, V, INTEGERS, SUBNORMAL
        )
    else:
        acc0, acc1, acc2, acc3 = _value_products(parts, pv, acc0, acc1, acc2, acc3, V)
    return acc0, acc1, acc2, acc3, zero_rows


@triton.jit
def ring_scores(k_rows, in_ring, rqs, D: tl.constexpr):
    """``S^T = K @ Q^T`` of ring keys whose rows start at ``k_rows [RING_BLOCK, 1]`` (rows not
    ``in_ring`` read as zeros), a quarter of the head dim at a time (``rqs``: the quarters of
    :func:`custom_ops.triton.decode.query.ring_query`)."""
    q0, q1, q2, q3 = rqs
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
def split_probabilities(p, dtype: tl.constexpr, F32: tl.constexpr):
    """``(p_hi, p_lo)``: ``p`` as two terms of the ring's 16-bit ``dtype``, ``p = hi + lo`` to
    ``2^-16`` relative for bf16 (both ``p`` itself with ``F32``), for :func:`ring_product`."""
    if F32:
        p_hi = p
        p_lo = p
    else:
        p_hi = p.to(dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(dtype)
    return p_hi, p_lo


@triton.jit
def ring_product(v_t, p_hi, p_lo, acc, F32: tl.constexpr):
    """``acc + v_t @ (p_hi + p_lo)`` for ring values ``v_t [rows, RING_BLOCK]`` in their own
    16-bit dtype (:func:`split_probabilities`): one float32 product with ``F32`` (``p_lo`` is
    ``p_hi`` there)."""
    # one return: the compiler would otherwise type-check the second product for float32 too
    if F32:
        acc = tl.dot(v_t.to(tl.float32), p_hi, acc)
    else:
        acc = tl.dot(v_t, p_lo, tl.dot(v_t, p_hi, acc))
    return acc


@triton.jit
def ring_values(p, v_rows, in_ring, acc0, acc1, acc2, acc3, V: tl.constexpr, F32: tl.constexpr):
    """``O^T += V^T @ P^T`` for ring values (original space) whose rows start at ``v_rows [1,
    RING_BLOCK]``, per value part of the compressed codes (part ``i``: elements ``[i * V.PC,
    (i + 1) * V.PC)``); float32 with ``F32``.

    On the tensor cores the ring's 16-bit values enter as they are (a bf16 -> fp16 conversion
    would cost a sixth of the ring loop's instructions), against ``P^T`` split into two terms of
    the ring's dtype, ``p = hi + lo`` to ``2^-16`` relative for bf16: as exact as fp16
    probabilities, for twice the (few) products."""
    V_PC: tl.constexpr = V.PC
    j = tl.arange(0, V.PC_PAD)[:, None]
    ok = in_ring[None, :] & (j < V_PC)
    p_hi, p_lo = split_probabilities(p, v_rows.dtype.element_ty, F32)
    acc0 = ring_product(tl.load(v_rows + j, mask=ok, other=0.0), p_hi, p_lo, acc0, F32)
    if V.PARTS > 1:
        acc1 = ring_product(tl.load(v_rows + V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc1, F32)
    if V.PARTS > 2:
        acc2 = ring_product(
            tl.load(v_rows + 2 * V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc2, F32
        )
        acc3 = ring_product(
            tl.load(v_rows + 3 * V_PC + j, mask=ok, other=0.0), p_hi, p_lo, acc3, F32
        )
    return acc0, acc1, acc2, acc3
