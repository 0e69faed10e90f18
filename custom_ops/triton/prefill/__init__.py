"""Prefill attention over a chunk and its compressed prefix: ``torch.ops.tq.prefill`` on CUDA.

Up to three launches, shapes fixed by the inputs (CUDA-graph safe, no host sync):

1. dense SDPA over the chunk's exact keys and values with its log-sum-exp
   (:func:`custom_ops.sdpa_lse.attention_lse`: the kernel SDPA itself picks, cuDNN on Hopper),
   causal unless the call has neither a mask nor ``is_causal``;
2. with a mask, the check of which mask rows are causal over the chunk
   (:mod:`~custom_ops.triton.prefill.causal_rows`): only those rows may keep step 1's result;
3. the prefill kernel (:mod:`~custom_ops.triton.prefill.prefix`): each query row's attention
   over the compressed prefix and the ring, merged with step 1's rows by log-sum-exp in place;
   rows step 1 cannot answer get the chunk's keys and values from the kernel itself. A program
   whose rows need nothing more (a first chunk: an empty prefix) returns at once.

A single-forward prefill therefore costs the bf16 model's attention plus a kernel of empty
programs; a later chunk reads its prefix's compressed bytes tile by tile (no dense copy of the
prefix, no ``[T, S]`` mask).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton

from custom_ops.formats import KVFormat, PagedKVCache, ring_window
from custom_ops.sdpa_lse import attention_lse
from custom_ops.triton.decode.codes import PartParams, part_params
from custom_ops.triton.decode.softmax import LOG2E
from custom_ops.triton.launch import Launcher
from custom_ops.triton.paged import (
    mask_arguments,
    plane_arguments,
    ring_arguments,
    table_arguments,
)
from custom_ops.triton.prefill.causal_rows import causal_rows
from custom_ops.triton.prefill.prefix import (
    CHUNK_CAUSAL,
    CHUNK_FULL,
    CHUNK_MASKED,
    prefill_kernel,
)

__all__ = ["PrefillConfig", "prefill"]


class PrefillConfig(NamedTuple):
    """The prefill kernel's launch: ``block_m`` query rows (tokens x GQA group) and
    ``block_n`` key positions per tile, ``num_warps``, ``num_stages``."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _token_run(page_size: int, block_n: int) -> int:
    """Tokens of a tile that are adjacent bytes of a value-code row (a tile starts at a multiple
    of ``block_n``): a run within one page, or 1 (no hint)."""
    if page_size % block_n == 0:
        return block_n
    return page_size if block_n % page_size == 0 else 1


@functools.lru_cache(maxsize=256)
def _launcher(key_params: PartParams, value_params: PartParams, group: int, head_dim: int,
              page_size: int, sinks: int, has_rings: bool, has_center: bool, mask_kind: int,
              is_causal: bool, chunk_mode: int, config: PrefillConfig) -> Launcher:  # fmt: skip
    return Launcher(prefill_kernel, dict(
        GROUP=group, D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        INV_SQRT_D=1.0 / math.sqrt(head_dim), PAGE_SIZE=page_size,
        TOKEN_RUN=_token_run(page_size, config.block_n), K=key_params, V=value_params,
        SINKS=sinks, HAS_RINGS=has_rings, HAS_CENTER=has_center, MASK=mask_kind,
        IS_CAUSAL=is_causal, CHUNK_MODE=chunk_mode, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
    ))  # fmt: skip


def prefill(
    fmt: KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    scale: float,
    is_causal: bool,
    max_seq_len: int,
    mask: torch.Tensor | None = None,
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
    window_pos: torch.Tensor | None = None,
    sinks: int = 0,
    key_center: torch.Tensor | None = None,
    fast: bool | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Launch the prefill (inputs validated; see ``torch.ops.tq.prefill``). A prefill's host time
    is small beside its work: the launches are not keyed by the op's metadata.

    Args:
        fmt, q, key, value, cache, block_table, seq_lens, rotation, scale, is_causal,
            max_seq_len, mask, k_window, v_window, window_pos, sinks, key_center: the op's
            arguments (the planes as ``cache``).
        fast: the inline-PTX decoding of codes (default: on CUDA; the interpreter cannot run
            it).
        config: the prefix kernel's launch (default :class:`PrefillConfig`).

    Returns:
        ``[B, Hq, T, D]`` contiguous, in q's dtype.
    """
    batch, num_q_heads, tokens, head_dim = q.shape
    num_kv_heads = key.shape[1]
    chunk_mode = CHUNK_MASKED if mask is not None else (CHUNK_CAUSAL if is_causal else CHUNK_FULL)
    out, lse = attention_lse(q, key, value, chunk_mode != CHUNK_FULL, scale)
    out = out if out.is_contiguous() else out.contiguous()
    if out.numel() == 0:
        return out
    fast = q.device.type == "cuda" if fast is None else fast
    config = PrefillConfig() if config is None else config
    mask_args = mask_arguments(mask, seq_lens)
    if mask is None:
        flags, flag_strides, mask_kind = seq_lens, (0, 0), 0
    else:
        mask_kind = 1 if mask.dtype == torch.bool else 2
        flags = causal_rows(mask_args, mask.shape[1], tokens, seq_lens, mask_kind == 2)
        flag_strides = (flags.stride(0), flags.stride(1) if flags.shape[1] > 1 else 0)
    has_rings = k_window is not None
    window = ring_window(k_window, sinks)
    if has_rings:
        rings = ring_arguments(k_window, v_window, window_pos)
    else:  # never read
        rings = (q, q, seq_lens, 0, 0, 0)
    group = num_q_heads // num_kv_heads
    sides = (part_params(fmt, "k", head_dim, fast), part_params(fmt, "v", head_dim, fast))
    launcher = _launcher(*sides, group, head_dim, cache.k_codes.shape[2], sinks, has_rings,
                         key_center is not None, mask_kind, is_causal, chunk_mode,
                         config)  # fmt: skip
    grid = (batch * num_kv_heads, triton.cdiv(tokens * group, config.block_m))
    launcher(grid, q, *q.stride()[:3], key, value, *key.stride()[:3], *value.stride()[:3], out,
             *out.stride()[:3], lse, *lse.stride(), plane_arguments(cache),
             table_arguments(block_table), seq_lens, rotation, rings,
             seq_lens if key_center is None else key_center, mask_args, flags, *flag_strides,
             num_kv_heads, tokens, window, block_table.shape[1], max_seq_len,
             scale * LOG2E)  # fmt: skip
    return out
