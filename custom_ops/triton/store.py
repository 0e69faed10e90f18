"""``tq.store`` on CUDA: fused quantize-and-store of new K/V token-heads into a paged cache.

One program encodes ``BLOCK_R`` token-head rows (row ``r`` = token ``r // Hk``, head ``r % Hk``)
of keys and of values: it reads the bf16/fp16 inputs once, computes each row's codes and meta
scalars in registers (:func:`custom_ops.triton.encode.encode_side`) and scatters them to the
row's slot. Slots that are negative (padding) or beyond the cache's capacity are skipped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from custom_ops.formats import KVFormat, PagedKVCache
from custom_ops.triton.encode import encode_side
from custom_ops.triton.launch import Launcher
from custom_ops.triton.paged import plane_arguments, row_pointers
from custom_ops.triton.planes import CodecParams, codec_params

__all__ = ["store_kernel", "store", "side_params"]


@triton.jit
def store_kernel(
    key_ptr,
    value_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    planes,
    slot_mapping_ptr,
    rot_ptr,
    num_rows,
    num_kv_heads,
    page_size,
    capacity,
    D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
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
    k_row, v_row, m_row = row_pointers(planes, page, head64, pos)
    tok64 = tok.to(tl.int64)
    encode_side(
        key_ptr,
        tok64 * stride_kn + head64 * stride_kh,
        stride_kd,
        ok,
        k_row,
        m_row,
        rot_ptr,
        K,
        D,
        INV_SQRT_D,
        BLOCK_R,
    )
    encode_side(
        value_ptr,
        tok64 * stride_vn + head64 * stride_vh,
        stride_vd,
        ok,
        v_row,
        m_row,
        rot_ptr,
        V,
        D,
        INV_SQRT_D,
        BLOCK_R,
    )


def side_params(
    fmt: KVFormat, cache: PagedKVCache, head_dim: int
) -> tuple[CodecParams, CodecParams]:
    """The key and value :class:`~custom_ops.triton.planes.CodecParams` of ``fmt`` for rows of
    ``cache`` (value rows token-minor, bytes ``page_size`` apart)."""
    return (
        codec_params(fmt, "k", head_dim, cache.k_codes.stride(3)),
        codec_params(fmt, "v", head_dim, cache.value_rows.stride(3)),
    )


@functools.lru_cache(maxsize=256)
def _launcher(
    fmt: KVFormat,
    key_params: CodecParams,
    value_params: CodecParams,
    head_dim: int,
    block_rows: int,
    num_warps: int,
) -> Launcher:
    return Launcher(
        store_kernel,
        dict(
            D=head_dim,
            INV_SQRT_D=1.0 / math.sqrt(head_dim),
            BLOCK_R=block_rows,
            K=key_params,
            V=value_params,
            num_warps=num_warps,
        ),
    )


def store(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    rotation: torch.Tensor,
    block_rows: int = 32,
    num_warps: int = 4,
    launch_key: Hashable | None = None,
) -> None:
    """Launch the store kernel (inputs already validated; see ``torch.ops.tq.store``;
    ``launch_key``: the launcher's specialization key, see
    :class:`~custom_ops.triton.launch.Launcher`)."""
    n_tokens, num_kv_heads, head_dim = key.shape
    num_rows = n_tokens * num_kv_heads
    if num_rows == 0:
        return
    num_pages, _, page_size, _ = cache.k_codes.shape
    launcher = _launcher(fmt, *side_params(fmt, cache, head_dim), head_dim, block_rows, num_warps)
    launcher(
        (triton.cdiv(num_rows, block_rows),),
        key,
        value,
        *key.stride(),
        *value.stride(),
        plane_arguments(cache),
        slot_mapping,
        rotation,
        num_rows,
        num_kv_heads,
        page_size,
        num_pages * page_size,
        key=launch_key,
    )
