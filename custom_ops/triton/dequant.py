"""Dequantize a paged cache into dense ``[B, Hk, S, D]`` K and V (the prefill fallback).

One program writes ``BLOCK_S`` positions of one (sequence, kv-head): it resolves each position's
page through the block table, unpacks the code planes, applies the codec's scalars and, for
Lloyd-Max codes, rotates back with one matmul against the +-1 rotation
(``x = (levels[codes] @ R.T) * (norm / sqrt(D))``, exact in tf32 because levels are fp16 values).
Positions at or beyond the sequence length are written as zeros. With a recent window, the last
``min(len, W)`` positions are copied from the full-precision ring instead.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from custom_ops.formats import Kind, KVFormat, PagedKVCache
from custom_ops.triton.planes import load_codes, rotation_slice, tile_offsets
from custom_ops.triton.store import codec_constexprs, first_meta_column

_LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
_UNIFORM = tl.constexpr(int(Kind.UNIFORM))
_FP8 = tl.constexpr(int(Kind.FP8))
_INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))


@triton.jit
def _decode_side(
    code_row,
    meta_row,
    valid,
    in_bounds,
    out_ptr,
    rot_ptr,
    levels_ptr,
    BYTE_STRIDE: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
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
    BLOCK_S: tl.constexpr,
):
    """Decode ``BLOCK_S`` code rows (``code_row [BLOCK_S]``, bytes ``BYTE_STRIDE`` apart) of one
    side into ``out_ptr [BLOCK_S]`` (row starts): zeros where not ``valid``, nothing where not
    ``in_bounds``."""
    e, e_mask = tile_offsets(G, C, C_PAD)
    out_mask = in_bounds[:, None, None] & e_mask
    out_ty = out_ptr.dtype.element_ty
    if KIND == _LLOYD_MAX:
        # x = levels[codes] @ R.T * (norm / sqrt(D)), one slice of RC columns per group at a time.
        codes = load_codes(code_row, valid, BYTE_STRIDE, W0, W1, OFF1, BLOCK_S, G, C, C_PAD)
        norm = tl.load(meta_row + META_COL, mask=valid, other=0.0).to(tl.float32)
        row_scale = tl.where(valid, norm * INV_SQRT_D, 0.0)[:, None, None]
        rotated = tl.where(e_mask, tl.load(levels_ptr + codes), 0.0)
        rotated = tl.reshape(rotated, (BLOCK_S, G * C_PAD))
        for col0 in tl.static_range(0, C_PAD, RC):
            rot_t = rotation_slice(rot_ptr, D, G, C, C_PAD, 0, G * C_PAD, col0, RC, True)
            x = tl.dot(rotated, rot_t, input_precision="tf32")
            x = tl.reshape(x, (BLOCK_S, G, RC)) * row_scale
            g = tl.arange(0, G)[None, :, None]
            c = col0 + tl.arange(0, RC)[None, None, :]
            mask = in_bounds[:, None, None] & (c < C)
            tl.store(out_ptr[:, None, None] + g * C + c, x.to(out_ty), mask=mask)
        return
    if KIND == _UNIFORM:
        codes = load_codes(code_row, valid, BYTE_STRIDE, W0, W1, OFF1, BLOCK_S, G, C, C_PAD)
        scale = tl.load(meta_row + META_COL, mask=valid, other=0.0).to(tl.float32)
        zero = tl.load(meta_row + META_COL + 1, mask=valid, other=0.0).to(tl.float32)
        x = codes.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
    else:
        byte_ptr = code_row[:, None, None] + e * BYTE_STRIDE
        byte = tl.load(byte_ptr, mask=valid[:, None, None] & e_mask, other=0)
        if KIND == _INT8_ABSMAX:
            x = byte.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if KIND != _FP8:
            scale = tl.load(meta_row + META_COL, mask=valid, other=0.0).to(tl.float32)
            x = x * scale[:, None, None]
    x = tl.where(valid[:, None, None], x, 0.0)
    tl.store(out_ptr[:, None, None] + e, x.to(out_ty), mask=out_mask)


@triton.jit
def _dequant_kernel(
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
    seq_lens_ptr,
    rot_ptr,
    codebooks_ptr,
    k_out_ptr,
    v_out_ptr,
    k_window_ptr,
    v_window_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    window,
    num_kv_heads,
    page_size,
    max_pages,
    max_seq_len,
    HAS_WINDOW: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
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
    batch_head = tl.program_id(0)
    b = batch_head // num_kv_heads
    head = (batch_head % num_kv_heads).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    # window is 0 without rings; with them the last window positions need no page
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_pages * page_size + window)
    out_row = (batch_head.to(tl.int64) * max_seq_len + pos) * D
    in_bounds = pos < max_seq_len
    valid = (pos < seq_len) & in_bounds
    if HAS_WINDOW:
        # The last min(len, W) positions are copied from the ring (position p at slot p % W);
        # the codes are decoded everywhere else.
        in_window = valid & (pos >= seq_len - window)
        ring_rows = b.to(tl.int64) * stride_w_b + head * stride_w_h
        ring_rows += (pos % window).to(tl.int64) * stride_w_slot
        d = tl.arange(0, D_PAD)[None, :]
        copy = in_window[:, None] & (d < D)
        out_ty = k_out_ptr.dtype.element_ty
        k_ring = tl.load(k_window_ptr + ring_rows[:, None] + d, mask=copy)
        v_ring = tl.load(v_window_ptr + ring_rows[:, None] + d, mask=copy)
        tl.store(k_out_ptr + out_row[:, None] + d, k_ring.to(out_ty), mask=copy)
        tl.store(v_out_ptr + out_row[:, None] + d, v_ring.to(out_ty), mask=copy)
        valid = valid & ~in_window
        in_bounds = in_bounds & ~in_window
    page_ptr = block_table_ptr + b * stride_bt_b + (pos // page_size) * stride_bt_p
    page = tl.load(page_ptr, mask=valid, other=0).to(tl.int64)
    slot = (pos % page_size).to(tl.int64)
    k_row = k_codes_ptr + page * stride_kc_page + head * stride_kc_head + slot * stride_kc_slot
    v_row = v_codes_ptr + page * stride_vc_page + head * stride_vc_head + slot * stride_vc_slot
    m_row = meta_ptr + page * stride_m_page + head * stride_m_head + slot * stride_m_slot
    _decode_side(
        k_row,
        m_row,
        valid,
        in_bounds,
        k_out_ptr + out_row,
        rot_ptr,
        codebooks_ptr,
        K_BYTE_STRIDE,
        K_KIND,
        K_BITS,
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
        BLOCK_S,
    )
    _decode_side(
        v_row,
        m_row,
        valid,
        in_bounds,
        v_out_ptr + out_row,
        rot_ptr,
        codebooks_ptr + CODEBOOK_STRIDE,
        V_BYTE_STRIDE,
        V_KIND,
        V_BITS,
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
        BLOCK_S,
    )


def dequantize(
    fmt: KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    max_seq_len: int,
    dtype: torch.dtype,
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
    block_s: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the dequantize kernel (inputs already validated; see ``torch.ops.tq.dequantize``)."""
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    head_dim = rotation.shape[0]
    batch = block_table.shape[0]
    shape = (batch, num_kv_heads, max_seq_len, head_dim)
    k_out = torch.empty(shape, dtype=dtype, device=cache.k_codes.device)
    v_out = torch.empty(shape, dtype=dtype, device=cache.k_codes.device)
    if k_out.numel() == 0:
        return k_out, v_out
    grid = (batch * num_kv_heads, triton.cdiv(max_seq_len, block_s))
    has_window = k_window is not None
    if has_window:
        window_args = (k_window, v_window, *k_window.stride()[:3], k_window.shape[2])
    else:
        window_args = (k_out, v_out, 0, 0, 0, 0)  # never read; no positions in a ring
    _dequant_kernel[grid](
        cache.k_codes,
        cache.v_codes,
        cache.meta,
        *cache.k_codes.stride()[:3],
        *cache.value_rows.stride()[:3],
        *cache.meta.stride()[:3],
        block_table,
        *block_table.stride(),
        seq_lens,
        rotation,
        codebooks,
        k_out,
        v_out,
        *window_args,
        num_kv_heads,
        page_size,
        block_table.shape[1],
        max_seq_len,
        HAS_WINDOW=has_window,
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        INV_SQRT_D=1.0 / math.sqrt(head_dim),
        BLOCK_S=block_s,
        K_BYTE_STRIDE=cache.k_codes.stride(3),
        V_BYTE_STRIDE=cache.value_rows.stride(3),
        **codec_constexprs("K", fmt.key, first_meta_column(fmt, "k"), head_dim),
        **codec_constexprs("V", fmt.value, first_meta_column(fmt, "v"), head_dim),
        CODEBOOK_STRIDE=codebooks.stride(0),
        num_warps=4,
    )
    return k_out, v_out
