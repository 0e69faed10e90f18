"""Dequantize a paged cache into dense ``[B, Hk, S, D]`` K and V (the prefill fallback).

One program writes ``BLOCK_S`` positions of one (sequence, kv-head): it resolves each position's
page through the block table, unpacks the code planes, applies the codec's scalars and, for
Lloyd-Max codes, rotates back with one matmul against the +-1 rotation
(``x = (levels[codes] @ R.T) * (norm / sqrt(D))``, exact in tf32 because levels are fp16 values).
Positions at or beyond the sequence length are written as zeros. With a recent window, each
sequence-head's ring run and sinks are copied from the full-precision ring instead.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from custom_ops.formats import KVFormat, PagedKVCache, RecentWindow
from custom_ops.reference import uncenter_keys
from custom_ops.triton.kinds import INT8_ABSMAX, LLOYD_MAX, UNIFORM
from custom_ops.triton.launch import Launcher
from custom_ops.triton.paged import (
    plane_arguments,
    ring_arguments,
    ring_slots,
    ring_start,
    row_pointers,
    table_arguments,
)
from custom_ops.triton.planes import (
    CodecParams,
    lloyd_max_levels,
    load_codes,
    rotation_slice,
    tile_offsets,
)
from custom_ops.triton.store import side_params

__all__ = ["dequant_kernel", "dequantize"]


@triton.jit
def _decode_side(
    code_row,
    meta_row,
    valid,
    in_bounds,
    out_ptr,
    rot_ptr,
    P: tl.constexpr,
    D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Decode ``BLOCK_S`` code rows (``code_row [BLOCK_S]``) of one side, the codec ``P`` (a
    :class:`~custom_ops.triton.planes.CodecParams`), into ``out_ptr [BLOCK_S]`` (row starts):
    zeros where not ``valid``, nothing where not ``in_bounds``."""
    G: tl.constexpr = P.G
    C: tl.constexpr = P.C
    C_PAD: tl.constexpr = P.C_PAD
    e, e_mask = tile_offsets(G, C, C_PAD)
    out_mask = in_bounds[:, None, None] & e_mask
    out_ty = out_ptr.dtype.element_ty
    if P.KIND == LLOYD_MAX:
        # x = levels[codes] @ R.T * (norm / sqrt(D)), one slice of RC columns per group at a time.
        RC: tl.constexpr = P.RC
        codes = load_codes(code_row, valid, P, BLOCK_S)
        norm = tl.load(meta_row + P.META, mask=valid, other=0.0).to(tl.float32)
        row_scale = tl.where(valid, norm * INV_SQRT_D, 0.0)[:, None, None]
        rotated = tl.where(e_mask, lloyd_max_levels(codes, P), 0.0)
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
    if P.KIND == UNIFORM:
        codes = load_codes(code_row, valid, P, BLOCK_S)
        scale = tl.load(meta_row + P.META, mask=valid, other=0.0).to(tl.float32)
        zero = tl.load(meta_row + P.META + 1, mask=valid, other=0.0).to(tl.float32)
        x = codes.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
    else:
        byte_ptr = code_row[:, None, None] + e * P.BYTE_STRIDE
        byte = tl.load(byte_ptr, mask=valid[:, None, None] & e_mask, other=0)
        if P.KIND == INT8_ABSMAX:
            x = byte.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(meta_row + P.META, mask=valid, other=0.0).to(tl.float32)
        x = x * scale[:, None, None]
    x = tl.where(valid[:, None, None], x, 0.0)
    tl.store(out_ptr[:, None, None] + e, x.to(out_ty), mask=out_mask)


@triton.jit
def dequant_kernel(
    planes,
    table,
    seq_lens_ptr,
    rot_ptr,
    k_out_ptr,
    v_out_ptr,
    rings,
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
    K: tl.constexpr,
    V: tl.constexpr,
    SINKS: tl.constexpr,
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
        # The ring run (from ring_start to the length) and the sinks are copied from the ring
        # (position p at slot p % W, a sink at W + p); the codes are decoded everywhere else.
        k_window_ptr, v_window_ptr, pos_ptr, stride_w_b, stride_w_h, stride_w_slot = rings
        ring_rows = b.to(tl.int64) * stride_w_b + head * stride_w_h
        first = ring_start(pos_ptr + ring_rows // D, seq_len, window)
        in_window = valid & ((pos >= first) | (pos < SINKS))
        ring_rows += ring_slots(pos, window, SINKS).to(tl.int64) * stride_w_slot
        d = tl.arange(0, D_PAD)[None, :]
        copy = in_window[:, None] & (d < D)
        out_ty = k_out_ptr.dtype.element_ty
        k_ring = tl.load(k_window_ptr + ring_rows[:, None] + d, mask=copy)
        v_ring = tl.load(v_window_ptr + ring_rows[:, None] + d, mask=copy)
        tl.store(k_out_ptr + out_row[:, None] + d, k_ring.to(out_ty), mask=copy)
        tl.store(v_out_ptr + out_row[:, None] + d, v_ring.to(out_ty), mask=copy)
        valid = valid & ~in_window
        in_bounds = in_bounds & ~in_window
    block_table_ptr, stride_bt_b, stride_bt_p = table
    page_ptr = block_table_ptr + b * stride_bt_b + (pos // page_size) * stride_bt_p
    page = tl.load(page_ptr, mask=valid, other=0).to(tl.int64)
    k_row, v_row, m_row = row_pointers(planes, page, head, (pos % page_size).to(tl.int64))
    _decode_side(
        k_row, m_row, valid, in_bounds, k_out_ptr + out_row, rot_ptr, K, D, INV_SQRT_D, BLOCK_S
    )
    _decode_side(
        v_row, m_row, valid, in_bounds, v_out_ptr + out_row, rot_ptr, V, D, INV_SQRT_D, BLOCK_S
    )


@functools.lru_cache(maxsize=256)
def _launcher(
    key_params: CodecParams,
    value_params: CodecParams,
    head_dim: int,
    has_window: bool,
    block_s: int,
    sinks: int,
) -> Launcher:
    return Launcher(
        dequant_kernel,
        dict(
            HAS_WINDOW=has_window,
            D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            INV_SQRT_D=1.0 / math.sqrt(head_dim),
            BLOCK_S=block_s,
            K=key_params,
            V=value_params,
            SINKS=sinks,
            num_warps=4,
        ),
    )


def dequantize(
    fmt: KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    max_seq_len: int,
    dtype: torch.dtype,
    window: RecentWindow | None = None,
    block_s: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the dequantize kernel (inputs already validated; see ``torch.ops.tq.dequantize``).
    With the window's ``key_center`` the keys are dequantized in float32, get their centres
    back (:func:`custom_ops.reference.uncenter_keys`) and are rounded to ``dtype`` once."""
    key_center = None if window is None else window.key_center
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    head_dim = rotation.shape[0]
    batch = block_table.shape[0]
    shape = (batch, num_kv_heads, max_seq_len, head_dim)
    k_dtype = dtype if key_center is None or dtype == torch.float64 else torch.float32
    k_out = torch.empty(shape, dtype=k_dtype, device=cache.k_codes.device)
    v_out = torch.empty(shape, dtype=dtype, device=cache.k_codes.device)
    if k_out.numel() == 0:
        return k_out.to(dtype), v_out
    grid = (batch * num_kv_heads, triton.cdiv(max_seq_len, block_s))
    has_window = window is not None
    if has_window:
        window_args = (ring_arguments(window), window.size)
    else:
        window_args = ((k_out, v_out, seq_lens, 0, 0, 0), 0)  # never read; no ring
    launcher = _launcher(
        *side_params(fmt, cache, head_dim),
        head_dim,
        has_window,
        block_s,
        0 if window is None else window.sinks,
    )
    launcher(
        grid,
        plane_arguments(cache),
        table_arguments(block_table),
        seq_lens,
        rotation,
        k_out,
        v_out,
        *window_args,
        num_kv_heads,
        page_size,
        block_table.shape[1],
        max_seq_len,
    )
    return uncenter_keys(k_out, key_center, seq_lens).to(dtype), v_out
