"""Fused quantize-and-store of new K/V token-heads into a paged cache.

One program encodes ``BLOCK_R`` token-head rows (row ``r`` = token ``r // Hk``, head ``r % Hk``)
of keys and of values: it reads the bf16/fp16 inputs once, computes each row's codes and meta
scalars in registers and scatters them to the row's slot. It reproduces
:func:`custom_ops.reference.encode_rows` operation by operation:

* Lloyd-Max: ``norm = ||x||``; ``y = (x @ R) * (1/sqrt(D) / norm)`` with the +-1 rotation R on
  the tensor cores (tf32 is exact here: bf16 and fp16 inputs and +-1 fit in tf32's mantissa);
  magnitude index = number of magnitude midpoints below ``|y|``; sign-magnitude code; with norm
  correction the stored norm is ``norm / ||levels[codes]||``.
* Uniform: fp16 scale ``(max - min) / (2^b - 1)`` and zero ``min``; codes from those rounded
  values: ``floor((x - zero) / scale + 0.5)``, clamped.
* FP8 / absmax: saturating e4m3 casts, ``floor(x / scale + 0.5)`` for int8.

Slots that are negative (padding) or beyond the cache's capacity are skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from custom_ops.formats import Codec, Kind, KVFormat, PagedKVCache
from custom_ops.reference import FP8_MAX, INT8_MAX, TINY_NORM
from custom_ops.triton.planes import PlaneParams, rotation_slice, store_codes, tile_offsets

_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
_FP8 = tl.constexpr(int(Kind.FP8))
_FP8_ABSMAX = tl.constexpr(int(Kind.FP8_ABSMAX))
_INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))
_TINY = tl.constexpr(TINY_NORM)
_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)


@triton.jit
def _row_sum(x):
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _reciprocal_or_zero(x):
    """``1 / x`` (IEEE) where ``x > 0``, else 0: one division per row, multiplies per element."""
    positive = x > 0
    return tl.where(
        positive,
        tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.where(positive, x, 1.0)),
        0.0,
    )


@triton.jit
def _encode_side(
    x_ptr,
    x_rows,
    stride_xd,
    ok,
    code_ptr,
    meta_ptr,
    rot_ptr,
    levels_ptr,
    BYTE_STRIDE: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    NC: tl.constexpr,
    META_COL: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    OFF1: tl.constexpr,
    G: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    RC: tl.constexpr,
    D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Encode one side (keys or values) of ``BLOCK_R`` rows and store codes and meta.

    ``x_rows [BLOCK_R]`` are the rows' element offsets from ``x_ptr``; ``code_ptr [BLOCK_R]`` /
    ``meta_ptr [BLOCK_R]`` point at each row's code row (bytes ``BYTE_STRIDE`` apart) and meta
    record.
    """
    e, e_mask = tile_offsets(G, C, C_PAD)  # [1, G, C_PAD]
    mask = ok[:, None, None] & e_mask
    x_offs = x_rows[:, None, None] + e * stride_xd
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, G, C_PAD]
    meta_ty = meta_ptr.dtype.element_ty

    if KIND == _LLOYD_MAX:
        norm = tl.sqrt_rn(_row_sum(x * x))
        inv = tl.math.div_rn(tl.full([BLOCK_R], INV_SQRT_D, tl.float32), tl.maximum(norm, _TINY))
        recon_sq = tl.zeros([BLOCK_R], tl.float32)
        # y = x @ R / sqrt(D) / norm: RC output columns per group at a time, contracting KC
        # tile positions at a time (x re-read from L1), so no rotation block needs > 32 KiB.
        KC: tl.constexpr = 32
        for col0 in tl.static_range(0, C_PAD, RC):
            y = tl.zeros([BLOCK_R, G * RC], tl.float32)
            for k0 in tl.static_range(0, G * C_PAD, KC):
                i = k0 + tl.arange(0, KC)
                i_elem = (i // C_PAD) * C + i % C_PAD
                x_offs = x_rows[:, None] + i_elem * stride_xd
                x_mask = ok[:, None] & ((i % C_PAD) < C)[None, :]
                x_k = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
                rot = rotation_slice(rot_ptr, D, G, C, C_PAD, k0, KC, col0, RC, False)
                y = tl.dot(x_k, rot, y, input_precision="tf32")
            y = tl.reshape(y, (BLOCK_R, G, RC)) * inv[:, None, None]
            magnitude = tl.abs(y)
            mag_index = tl.zeros([BLOCK_R, G, RC], dtype=tl.int32)
            level = tl.zeros([BLOCK_R, G, RC], dtype=tl.float32) + tl.load(levels_ptr)
            for m in tl.static_range((1 << (BITS - 1)) - 1):
                upper = tl.load(levels_ptr + m + 1)
                above = magnitude > (tl.load(levels_ptr + m) + upper) * 0.5
                mag_index += above.to(tl.int32)
                level = tl.where(above, upper, level)
            codes = ((y < 0).to(tl.int32) << (BITS - 1)) | mag_index
            if NC:
                col_ok = (col0 + tl.arange(0, RC))[None, None, :] < C
                recon_sq += _row_sum(tl.where(col_ok, level * level, 0.0))
            store_codes(codes, code_ptr, ok, BYTE_STRIDE, W0, W1, OFF1, BLOCK_R, G, C, col0, RC)
        stored = norm
        if NC:
            stored = tl.math.div_rn(norm, tl.sqrt_rn(recon_sq))
        tl.store(meta_ptr + META_COL, stored.to(meta_ty), mask=ok)
    elif KIND == _UNIFORM:
        QMAX: tl.constexpr = (1 << BITS) - 1
        lo = tl.min(tl.min(tl.where(e_mask, x, float("inf")), axis=2), axis=1)
        hi = tl.max(tl.max(tl.where(e_mask, x, float("-inf")), axis=2), axis=1)
        scale16 = tl.math.div_rn(hi - lo, tl.full([BLOCK_R], QMAX, tl.float32)).to(tl.float16)
        zero16 = lo.to(tl.float16)
        scale = scale16.to(tl.float32)
        zero = zero16.to(tl.float32)[:, None, None]
        inv = _reciprocal_or_zero(scale)[:, None, None]
        q = tl.floor((x - zero) * inv + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), QMAX)
        tl.store(meta_ptr + META_COL, scale16.to(meta_ty), mask=ok)
        tl.store(meta_ptr + META_COL + 1, zero16.to(meta_ty), mask=ok)
        store_codes(q.to(tl.int32), code_ptr, ok, BYTE_STRIDE, W0, W1, OFF1, BLOCK_R, G, C, 0,
                    C_PAD)  # fmt: skip
    else:
        if KIND == _FP8:
            scaled = x
        else:
            QMAX_ABS: tl.constexpr = _FP8_MAX if KIND == _FP8_ABSMAX else _INT8_MAX
            absmax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
            scale = tl.math.div_rn(absmax, tl.full([BLOCK_R], QMAX_ABS, tl.float32))
            tl.store(meta_ptr + META_COL, scale.to(meta_ty), mask=ok)
            scaled = x * _reciprocal_or_zero(scale)[:, None, None]
        if KIND == _INT8_ABSMAX:
            q = tl.minimum(tl.maximum(tl.floor(scaled + 0.5), -128.0), 127.0)
            byte = q.to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            byte = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # 8-bit codes: one plane, G == 1, element e at byte e.
        tl.store(code_ptr[:, None, None] + e * BYTE_STRIDE, byte, mask=mask)


@triton.jit
def _store_kernel(
    key_ptr,
    value_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    k_codes_ptr,
    v_codes_ptr,
    meta_ptr,
    stride_kc_page,
    stride_kc_head,
    stride_kc_slot,
    stride_vc_page,
    stride_vc_head,
    stride_vc_slot,
    stride_m_page,
    stride_m_head,
    stride_m_slot,
    slot_mapping_ptr,
    rot_ptr,
    codebooks_ptr,
    num_rows,
    num_kv_heads,
    page_size,
    capacity,
    D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K_BYTE_STRIDE: tl.constexpr,
    V_BYTE_STRIDE: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_NC: tl.constexpr,
    K_META: tl.constexpr,
    K_W0: tl.constexpr,
    K_W1: tl.constexpr,
    K_OFF1: tl.constexpr,
    K_G: tl.constexpr,
    K_C: tl.constexpr,
    K_C_PAD: tl.constexpr,
    K_RC: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_NC: tl.constexpr,
    V_META: tl.constexpr,
    V_W0: tl.constexpr,
    V_W1: tl.constexpr,
    V_OFF1: tl.constexpr,
    V_G: tl.constexpr,
    V_C: tl.constexpr,
    V_C_PAD: tl.constexpr,
    V_RC: tl.constexpr,
    CODEBOOK_STRIDE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    tok = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_mapping_ptr + tok, mask=in_range, other=-1)
    ok = in_range & (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0).to(tl.int64)
    page = slot // page_size
    pos = slot % page_size
    head64 = head.to(tl.int64)
    k_row = k_codes_ptr + page * stride_kc_page + head64 * stride_kc_head + pos * stride_kc_slot
    v_row = v_codes_ptr + page * stride_vc_page + head64 * stride_vc_head + pos * stride_vc_slot
    m_row = meta_ptr + page * stride_m_page + head64 * stride_m_head + pos * stride_m_slot
    tok64 = tok.to(tl.int64)
    _encode_side(
        key_ptr,
        tok64 * stride_kn + head64 * stride_kh,
        stride_kd,
        ok,
        k_row,
        m_row,
        rot_ptr,
        codebooks_ptr,
        K_BYTE_STRIDE,
        K_KIND,
        K_BITS,
        K_NC,
        K_META,
        K_W0,
        K_W1,
        K_OFF1,
        K_G,
        K_C,
        K_C_PAD,
        K_RC,
        D,
        INV_SQRT_D,
        BLOCK_R,
    )
    _encode_side(
        value_ptr,
        tok64 * stride_vn + head64 * stride_vh,
        stride_vd,
        ok,
        v_row,
        m_row,
        rot_ptr,
        codebooks_ptr + CODEBOOK_STRIDE,
        V_BYTE_STRIDE,
        V_KIND,
        V_BITS,
        V_NC,
        V_META,
        V_W0,
        V_W1,
        V_OFF1,
        V_G,
        V_C,
        V_C_PAD,
        V_RC,
        D,
        INV_SQRT_D,
        BLOCK_R,
    )


@triton.jit
def _window_kernel(
    key_ptr,
    value_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    k_window_ptr,
    v_window_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    k_codes_ptr,
    v_codes_ptr,
    meta_ptr,
    stride_kc_page,
    stride_kc_head,
    stride_kc_slot,
    stride_vc_page,
    stride_vc_head,
    stride_vc_slot,
    stride_m_page,
    stride_m_head,
    stride_m_slot,
    block_table_ptr,
    stride_bt_b,
    stride_bt_p,
    start_pos_ptr,
    rot_ptr,
    codebooks_ptr,
    num_rows,
    num_kv_heads,
    num_new,
    num_chains,
    window,
    page_size,
    max_pages,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K_BYTE_STRIDE: tl.constexpr,
    V_BYTE_STRIDE: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_NC: tl.constexpr,
    K_META: tl.constexpr,
    K_W0: tl.constexpr,
    K_W1: tl.constexpr,
    K_OFF1: tl.constexpr,
    K_G: tl.constexpr,
    K_C: tl.constexpr,
    K_C_PAD: tl.constexpr,
    K_RC: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_NC: tl.constexpr,
    V_META: tl.constexpr,
    V_W0: tl.constexpr,
    V_W1: tl.constexpr,
    V_OFF1: tl.constexpr,
    V_G: tl.constexpr,
    V_C: tl.constexpr,
    V_C_PAD: tl.constexpr,
    V_RC: tl.constexpr,
    CODEBOOK_STRIDE: tl.constexpr,
):
    """Row ``(b, chain, head)``: ring slot ``(start + chain) % W`` of sequence ``b``. Its old
    token (position ``start + chain - W``) leaves the window and is quantized; then the last new
    token of the chain ``chain, chain + W, ...`` takes the slot."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    head = rows % num_kv_heads
    chain = (rows // num_kv_heads) % num_chains
    b = rows // (num_kv_heads * num_chains)
    start = tl.load(start_pos_ptr + b, mask=in_range, other=-1)
    live = in_range & (start >= 0)
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)
    ring_slot = (tl.maximum(start, 0) + chain) % window
    ring_rows = b64 * stride_w_b + head64 * stride_w_h + ring_slot.to(tl.int64) * stride_w_slot

    # 1. quantize the token leaving the ring into its page slot
    leaving = start + chain - window
    page_index = tl.maximum(leaving, 0) // page_size
    evict = live & (leaving >= 0) & (page_index < max_pages)
    page_ptr = block_table_ptr + b64 * stride_bt_b + page_index * stride_bt_p
    page = tl.load(page_ptr, mask=evict, other=0).to(tl.int64)
    slot = (tl.maximum(leaving, 0) % page_size).to(tl.int64)
    k_row = k_codes_ptr + page * stride_kc_page + head64 * stride_kc_head + slot * stride_kc_slot
    v_row = v_codes_ptr + page * stride_vc_page + head64 * stride_vc_head + slot * stride_vc_slot
    m_row = meta_ptr + page * stride_m_page + head64 * stride_m_head + slot * stride_m_slot
    _encode_side(k_window_ptr, ring_rows, 1, evict, k_row, m_row, rot_ptr, codebooks_ptr,
                 K_BYTE_STRIDE, K_KIND, K_BITS, K_NC, K_META, K_W0, K_W1, K_OFF1, K_G, K_C,
                 K_C_PAD, K_RC, D, INV_SQRT_D, BLOCK_R)  # fmt: skip
    _encode_side(v_window_ptr, ring_rows, 1, evict, v_row, m_row, rot_ptr,
                 codebooks_ptr + CODEBOOK_STRIDE, V_BYTE_STRIDE, V_KIND, V_BITS, V_NC, V_META,
                 V_W0, V_W1, V_OFF1, V_G, V_C, V_C_PAD, V_RC, D, INV_SQRT_D,
                 BLOCK_R)  # fmt: skip
    # Every thread's reads of the old ring rows happen before any thread overwrites them.
    tl.debug_barrier()

    # 2. the chain's last new token (the only one of it that stays in the window) takes the slot
    newest = chain + window * ((num_new - 1 - chain) // window)
    d = tl.arange(0, D_PAD)[None, :]
    copy_mask = live[:, None] & (d < D)
    newest64 = newest.to(tl.int64)
    k_src = key_ptr + b64 * stride_kb + head64 * stride_kh + newest64 * stride_kt
    v_src = value_ptr + b64 * stride_vb + head64 * stride_vh + newest64 * stride_vt
    k_new = tl.load(k_src[:, None] + d * stride_kd, mask=copy_mask)
    v_new = tl.load(v_src[:, None] + d * stride_vd, mask=copy_mask)
    w_dst = ring_rows[:, None] + d
    tl.store(k_window_ptr + w_dst, k_new.to(k_window_ptr.dtype.element_ty), mask=copy_mask)
    tl.store(v_window_ptr + w_dst, v_new.to(v_window_ptr.dtype.element_ty), mask=copy_mask)


def codec_constexprs(prefix: str, codec: Codec, meta_col: int, head_dim: int) -> dict:
    """The compile-time parameters describing one side's codec, named ``<prefix>_*``."""
    planes = PlaneParams.of(codec, head_dim)
    return {
        f"{prefix}_KIND": int(codec.kind),
        f"{prefix}_BITS": codec.bits,
        f"{prefix}_NC": codec.norm_correction,
        f"{prefix}_META": meta_col,
        f"{prefix}_W0": planes.w0,
        f"{prefix}_W1": planes.w1,
        f"{prefix}_OFF1": planes.off1,
        f"{prefix}_G": planes.groups,
        f"{prefix}_C": planes.chunk,
        f"{prefix}_C_PAD": planes.chunk_pad,
        f"{prefix}_RC": planes.rot_cols,
    }


def first_meta_column(fmt: KVFormat, side: str) -> int:
    """Meta column of a side's first field (0 when the side has none; then it is unused)."""
    codec = fmt.key if side == "k" else fmt.value
    if not codec.meta_fields:
        return 0
    return fmt.meta_index(f"{side}_{codec.meta_fields[0]}")


def store(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    block_rows: int = 32,
    num_warps: int = 4,
) -> None:
    """Launch the store kernel (inputs already validated; see ``torch.ops.tq.store``)."""
    n_tokens, num_kv_heads, head_dim = key.shape
    num_rows = n_tokens * num_kv_heads
    if num_rows == 0:
        return
    num_pages, _, page_size, _ = cache.k_codes.shape
    grid = (triton.cdiv(num_rows, block_rows),)
    _store_kernel[grid](
        key,
        value,
        *key.stride(),
        *value.stride(),
        cache.k_codes,
        cache.v_codes,
        cache.meta,
        *cache.k_codes.stride()[:3],
        *cache.value_rows.stride()[:3],
        *cache.meta.stride()[:3],
        slot_mapping,
        rotation,
        codebooks,
        num_rows,
        num_kv_heads,
        page_size,
        num_pages * page_size,
        D=head_dim,
        INV_SQRT_D=1.0 / math.sqrt(head_dim),
        BLOCK_R=block_rows,
        K_BYTE_STRIDE=cache.k_codes.stride(3),
        V_BYTE_STRIDE=cache.value_rows.stride(3),
        **codec_constexprs("K", fmt.key, first_meta_column(fmt, "k"), head_dim),
        **codec_constexprs("V", fmt.value, first_meta_column(fmt, "v"), head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        num_warps=num_warps,
    )


def store_window(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    block_rows: int = 32,
    num_warps: int = 4,
) -> None:
    """Launch the window store (inputs validated; see ``torch.ops.tq.store_window``).

    One launch of ``_window_kernel`` over ``B * min(T, W) * Hk`` rows moves every token that
    leaves the ring into the paged cache and writes the ring. When ``T > W`` the first ``T - W``
    new tokens never enter the ring: one more launch of the plain store kernel quantizes them
    straight into their slots (computed on the device from ``start_pos``). The two launches
    touch disjoint memory.
    """
    batch, num_kv_heads, n_new, head_dim = key.shape
    window = k_window.shape[2]
    if batch == 0 or n_new == 0:
        return
    page_size = cache.k_codes.shape[2]
    if n_new > window:
        positions = start_pos[:, None].to(torch.int64) + torch.arange(
            n_new - window, device=key.device
        )  # [B, T - W]
        page_index = positions // page_size
        in_table = (start_pos[:, None] >= 0) & (page_index < block_table.shape[1])
        pages = block_table[:batch].gather(1, page_index.clamp(0, block_table.shape[1] - 1))
        slots = torch.where(in_table, pages * page_size + positions % page_size, -1)

        def rows_of(x):  # [B, Hk, T, D] -> [B * (T - W), Hk, D], in the slots' order
            return x[:, :, : n_new - window].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)

        store(fmt, rows_of(key), rows_of(value), cache, slots.reshape(-1).to(torch.int32),
              rotation, codebooks, block_rows, num_warps)  # fmt: skip
    num_chains = min(n_new, window)
    num_rows = batch * num_chains * num_kv_heads
    _window_kernel[(triton.cdiv(num_rows, block_rows),)](
        key,
        value,
        *key.stride(),
        *value.stride(),
        k_window,
        v_window,
        *k_window.stride()[:3],
        cache.k_codes,
        cache.v_codes,
        cache.meta,
        *cache.k_codes.stride()[:3],
        *cache.value_rows.stride()[:3],
        *cache.meta.stride()[:3],
        block_table,
        *block_table.stride(),
        start_pos,
        rotation,
        codebooks,
        num_rows,
        num_kv_heads,
        n_new,
        num_chains,
        window,
        page_size,
        block_table.shape[1],
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        INV_SQRT_D=1.0 / math.sqrt(head_dim),
        BLOCK_R=block_rows,
        K_BYTE_STRIDE=cache.k_codes.stride(3),
        V_BYTE_STRIDE=cache.value_rows.stride(3),
        **codec_constexprs("K", fmt.key, first_meta_column(fmt, "k"), head_dim),
        **codec_constexprs("V", fmt.value, first_meta_column(fmt, "v"), head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        num_warps=num_warps,
    )
