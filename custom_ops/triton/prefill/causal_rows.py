"""Which rows of a prefill's attention mask are causal over the chunk and show the whole prefix:
the check that lets a masked prefill use the dense kernel's causal attention for the chunk (and
unmasked dense attention for a dequantized prefix).

A model's prefill mask ``[B or 1, Hq or 1, T, M]`` (gpt-fast's ``causal_mask[input_pos]``,
Hugging Face's 4-D mask) is usually causal over the chunk's own positions ``start .. start + T -
1``, and then the chunk's attention is exactly what SDPA computes with ``is_causal=True`` (cuDNN,
no mask). Row ``t`` is causal when it lets token ``t`` see chunk positions ``start + j`` for
``j <= t`` and none for ``j > t`` (bool True / False; an additive mask 0 / -inf, anything else
counts as not causal, but an additive mask's finite "minus infinity", such as ``finfo.min``,
hides as -inf does: at or below :data:`custom_ops.reference.HIDDEN_BIAS` a position's weight
is 0 beside the row's visible ones). A row shows the whole prefix when it lets its token see
every position below ``start`` (bool True, additive 0). One program checks ``BLOCK_T`` rows of
one (sequence, mask head) against every chunk column, and every prefix column when asked; the
prefill kernel recomputes the chunk itself for the rows that fail (padding, a bidirectional
prefix, a sliding window).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from custom_ops.reference import HIDDEN_BIAS
from custom_ops.triton.launch import Launcher

__all__ = ["causal_rows_kernel", "causal_rows", "CAUSAL_OVER_CHUNK", "SHOWS_PREFIX"]

_HIDDEN = tl.constexpr(HIDDEN_BIAS)
# The bits of a row's flag.
CAUSAL_OVER_CHUNK = 1
SHOWS_PREFIX = 2
_CAUSAL = tl.constexpr(CAUSAL_OVER_CHUNK)
_SHOWS = tl.constexpr(SHOWS_PREFIX)


@triton.jit
def causal_rows_kernel(
    mask_ptr,
    stride_mb,
    stride_mh,
    stride_mt,
    mask_len,
    seq_lens_ptr,
    flags_ptr,
    num_mask_heads,
    tokens,
    FLOAT: tl.constexpr,
    CHECK_PREFIX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    batch_head = tl.program_id(0)
    b = batch_head // num_mask_heads
    head = batch_head % num_mask_heads
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    start = tl.maximum(tl.load(seq_lens_ptr + b) - tokens, 0)
    rows = (
        mask_ptr
        + b.to(tl.int64) * stride_mb
        + head.to(tl.int64) * stride_mh
        + t.to(tl.int64) * stride_mt
    )
    causal = t_ok
    for j0 in range(0, tokens, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        position = start + j
        in_chunk = t_ok[:, None] & (j < tokens)[None, :]
        loaded = in_chunk & (position < mask_len)[None, :]
        m = tl.load(rows[:, None] + position[None, :], mask=loaded, other=0)
        if FLOAT:
            visible = loaded & (m == 0.0)
            hidden = ~loaded | (m <= _HIDDEN)
        else:
            visible = loaded & (m != 0)
            hidden = ~visible
        wanted = tl.where(j[None, :] <= t[:, None], visible, hidden) | ~in_chunk
        causal = causal & (tl.min(wanted.to(tl.int32), axis=1) > 0)
    shows_prefix = t_ok & (start == 0)  # unchecked: only an empty prefix is known to be shown
    if CHECK_PREFIX:
        shows_prefix = t_ok
        for p0 in range(0, start, BLOCK_J):
            p = p0 + tl.arange(0, BLOCK_J)
            in_prefix = t_ok[:, None] & (p < start)[None, :]
            loaded = in_prefix & (p < mask_len)[None, :]
            m = tl.load(rows[:, None] + p[None, :], mask=loaded, other=0)
            visible = loaded & ((m == 0.0) if FLOAT else (m != 0))
            shown = visible | ~in_prefix
            shows_prefix = shows_prefix & (tl.min(shown.to(tl.int32), axis=1) > 0)
    flag = causal.to(tl.int8) * _CAUSAL + shows_prefix.to(tl.int8) * _SHOWS
    tl.store(flags_ptr + batch_head * tokens + t, flag, mask=t_ok)


@functools.lru_cache(maxsize=16)
def _launcher(is_float: bool, check_prefix: bool, block_t: int, block_j: int) -> Launcher:
    return Launcher(
        causal_rows_kernel,
        dict(
            FLOAT=is_float,
            CHECK_PREFIX=check_prefix,
            BLOCK_T=block_t,
            BLOCK_J=block_j,
            num_warps=4,
        ),
    )


def causal_rows(
    mask_args: tuple,
    num_mask_heads: int,
    tokens: int,
    seq_lens: torch.Tensor,
    is_float: bool,
    check_prefix: bool = True,
    block_t: int = 16,
    block_j: int = 256,
) -> torch.Tensor:
    """Which mask rows are causal over each sequence's chunk.

    Args:
        mask_args: ``(mask, stride_b, stride_h, stride_t, M)`` of a mask ``[B or 1, Hm, T, M]``
            (bool, or additive if ``is_float``; last dim contiguous; the stride of a dimension
            of size 1 is 0).
        num_mask_heads: Hm.
        tokens: T.
        seq_lens: ``[B] int32``: sequence ``b``'s chunk is at positions ``seq_lens[b] - T ..``.
        is_float: an additive mask.
        check_prefix: read the prefix's columns too (without, only an empty prefix counts as
            shown).
        block_t, block_j: rows and columns per tile.

    Returns:
        ``[B, Hm, T] int8`` bit flags: :data:`CAUSAL_OVER_CHUNK` where the row is causal over
        the chunk, :data:`SHOWS_PREFIX` where it shows every prefix position.
    """
    batch = seq_lens.shape[0]
    flags = torch.empty(batch, num_mask_heads, tokens, dtype=torch.int8, device=seq_lens.device)
    if flags.numel() == 0:
        return flags
    grid = (batch * num_mask_heads, triton.cdiv(tokens, block_t))
    launcher = _launcher(is_float, check_prefix, block_t, block_j)
    launcher(grid, *mask_args, seq_lens, flags, num_mask_heads, tokens)
    return flags
