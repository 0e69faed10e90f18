"""Prefill attention over a chunk and its compressed prefix: ``torch.ops.tq.prefill`` on CUDA.

1. Dense SDPA over the chunk's exact keys and values with its log-sum-exp
   (:func:`custom_ops.sdpa_lse.attention_lse`: the kernel SDPA itself picks, cuDNN on Hopper),
   causal unless the call has neither a mask nor ``is_causal``.
2. With a mask, the check of which mask rows are causal over the chunk and show the whole
   prefix (:mod:`~custom_ops.triton.prefill.causal_rows`).
3. The prefix, one of two ways:

   * **dense** (the default outside CUDA-graph capture): where every sequence has the same
     prefix length ``P`` and every row sees all of it (no mask, or a mask the check accepted,
     no top-left ``is_causal`` over a prefix, no view cutting the chunk), the prefix is
     dequantized into a ``[B, Hk, P, D]`` workspace (``P``, not the capacity: the caching
     allocator hands the same block to every layer) and attended by the dense kernel again
     (cuDNN at its unmasked rate), then merged by log-sum-exp
     (:mod:`~custom_ops.triton.prefill.merge`). Deciding needs ``P`` and the check on the host:
     one device-to-host copy per call, queued before step 1 and waited for while step 1 runs
     (the GPU does not idle). A first chunk (``P`` = 0) is step 1's result as it is.
   * **fused** (CUDA-graph capture, which cannot read the device; a view no longer than the
     chunk, which leaves no prefix to read where it does not cut a sequence; every other
     case): the prefill kernel (:mod:`~custom_ops.triton.prefill.prefix`) reads the compressed
     pages tile by tile, no host sync and no workspace, and finishes each row in place; rows
     step 1 cannot answer get the chunk's keys and values from the kernel itself. A program
     whose rows need nothing more returns at once.

The dense prefix is the faster one by several times on an H200 (``docs/prefill.md``);
:func:`fused_prefix` forces the fused kernel (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from custom_ops.formats import KVFormat, PagedKVCache, RecentWindow, window_size
from custom_ops.sdpa_lse import attention_lse
from custom_ops.thread_flag import ThreadFlag
from custom_ops.triton.decode.codes import PartParams, part_params
from custom_ops.triton.decode.softmax import LOG2E
from custom_ops.triton.dequant import dequantize
from custom_ops.triton.launch import Launcher
from custom_ops.triton.paged import (
    mask_arguments,
    plane_arguments,
    ring_arguments,
    table_arguments,
)
from custom_ops.triton.prefill.causal_rows import CAUSAL_OVER_CHUNK, SHOWS_PREFIX, causal_rows
from custom_ops.triton.prefill.merge import merge_prefix
from custom_ops.triton.prefill.prefix import (
    CHUNK_CAUSAL,
    CHUNK_FULL,
    CHUNK_MASKED,
    prefill_kernel,
)

__all__ = ["PrefillConfig", "prefill", "fused_prefix"]

_FUSED = ThreadFlag()


def fused_prefix() -> contextlib.AbstractContextManager[None]:
    """Within it, prefills on this thread read their prefix by the fused kernel only (what a
    CUDA-graph capture runs): no dequantized workspace, no host sync."""
    return _FUSED.set()


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
def _launcher(
    key_params: PartParams,
    value_params: PartParams,
    group: int,
    head_dim: int,
    page_size: int,
    sinks: int,
    has_rings: bool,
    has_center: bool,
    mask_kind: int,
    is_causal: bool,
    chunk_mode: int,
    config: PrefillConfig,
) -> Launcher:
    return Launcher(
        prefill_kernel,
        dict(
            GROUP=group,
            D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            INV_SQRT_D=1.0 / math.sqrt(head_dim),
            PAGE_SIZE=page_size,
            TOKEN_RUN=_token_run(page_size, config.block_n),
            K=key_params,
            V=value_params,
            SINKS=sinks,
            HAS_RINGS=has_rings,
            HAS_CENTER=has_center,
            MASK=mask_kind,
            IS_CAUSAL=is_causal,
            CHUNK_MODE=chunk_mode,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )


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
    window: RecentWindow | None = None,
    fast: bool | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Launch the prefill (inputs validated; see ``torch.ops.tq.prefill``). A prefill's host time
    is small beside its work: the launches are not keyed by the op's metadata.

    Args:
        fmt, q, key, value, cache, block_table, seq_lens, rotation, scale, is_causal,
            max_seq_len, mask: the op's arguments (the planes as ``cache``).
        window: the recent window (the op's ring arguments), or None.
        fast: the inline-PTX decoding of codes (default: on CUDA; the interpreter cannot run
            it).
        config: the prefix kernel's launch (default :class:`PrefillConfig`).

    Returns:
        ``[B, Hq, T, D]`` in q's dtype, laid out as the dense kernel returns it (the op gives
        it q's layout).
    """
    batch, num_q_heads, tokens, head_dim = q.shape
    num_kv_heads = key.shape[1]
    if q.numel() == 0:
        return torch.empty_like(q)
    chunk_mode = CHUNK_MASKED if mask is not None else (CHUNK_CAUSAL if is_causal else CHUNK_FULL)
    # A view no longer than the chunk (the trim before a first prefill: Hugging Face's, the
    # example model's causal prompt) leaves no prefix to read in any sequence it does not cut:
    # the fused kernel then checks that on the device, its programs returning at once, instead
    # of a host sync per layer, which lets the GPU idle while the host catches up at short
    # prompts (docs/prefill.md, time to first token).
    dense = (
        max_seq_len > tokens
        and not _FUSED.on
        and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    )
    mask_args = mask_arguments(mask, seq_lens)
    flags = None
    if mask is not None:
        flags = causal_rows(
            mask_args,
            mask.shape[1],
            tokens,
            seq_lens,
            mask.dtype != torch.bool,
            check_prefix=dense and not is_causal,
        )
    capacity = block_table.shape[1] * cache.k_codes.shape[2] + window_size(window)
    key_center = None if window is None else window.key_center
    # what the dense prefix decides by starts for the host now; the chunk's attention runs
    # meanwhile
    facts = _prefix_facts(seq_lens, tokens, capacity, flags) if dense else None
    out, lse = attention_lse(q, key, value, chunk_mode != CHUNK_FULL, scale)
    if facts is not None:
        prefix_lens, wait = facts
        prefix_len = _uniform_prefix(wait(), max_seq_len, is_causal)
        if prefix_len == 0:
            return out
        if prefix_len is not None:
            # the keys as stored: the merge adds the centres' share to the scores
            stored = None if window is None else window._replace(key_center=None)
            keys, values = dequantize(
                fmt, cache, block_table, prefix_lens, rotation, prefix_len, q.dtype, stored
            )
            prefix_out, prefix_lse = attention_lse(q, keys, values, False, scale)
            merge_prefix(out, lse, prefix_out, prefix_lse, q, scale, key_center)
            return out
    fast = q.device.type == "cuda" if fast is None else fast
    config = PrefillConfig() if config is None else config
    if flags is None:
        flags, flag_strides = seq_lens, (0, 0)
    else:
        flag_strides = (flags.stride(0), flags.stride(1) if flags.shape[1] > 1 else 0)
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    has_rings = window is not None
    if has_rings:
        rings = ring_arguments(window)
    else:  # never read
        rings = (q, q, seq_lens, 0, 0, 0)
    group = num_q_heads // num_kv_heads
    sides = (part_params(fmt, "k", head_dim, fast), part_params(fmt, "v", head_dim, fast))
    launcher = _launcher(
        *sides,
        group,
        head_dim,
        cache.k_codes.shape[2],
        window.sinks if has_rings else 0,
        has_rings,
        key_center is not None,
        mask_kind,
        is_causal,
        chunk_mode,
        config,
    )
    grid = (batch * num_kv_heads, triton.cdiv(tokens * group, config.block_m))
    launcher(
        grid,
        q,
        *q.stride()[:3],
        key,
        value,
        *key.stride()[:3],
        *value.stride()[:3],
        out,
        *out.stride()[:3],
        lse,
        *lse.stride(),
        plane_arguments(cache),
        table_arguments(block_table),
        seq_lens,
        rotation,
        rings,
        seq_lens if key_center is None else key_center,
        mask_args,
        flags,
        *flag_strides,
        num_kv_heads,
        tokens,
        window_size(window),
        block_table.shape[1],
        max_seq_len,
        scale * LOG2E,
    )
    return out


def _prefix_facts(
    seq_lens: torch.Tensor, tokens: int, capacity: int, flags: torch.Tensor | None
) -> tuple[torch.Tensor, Callable[[], list[int]]]:
    """Each sequence's prefix length, and start copying to the host what
    :func:`_uniform_prefix` decides by: the longest and the shortest prefix, the longest
    sequence and the mask rows' least flag.

    Returns:
        ``(prefix_lens [B] int32, wait)``: ``wait()`` returns the facts; on CUDA it waits on
        an event after the copy, so that the host waits for these small reductions only while
        the kernels queued after them (the chunk's attention) keep the GPU busy.
    """
    lens = seq_lens.clamp(max=capacity)
    prefix = (lens - tokens).clamp(min=0)
    facts = [prefix.amax(), prefix.amin(), lens.amax()]
    if flags is not None:
        facts.append(flags.amin().to(prefix.dtype))
    facts = torch.stack(facts)
    prefix = prefix.to(torch.int32)
    if facts.device.type != "cuda":
        return prefix, facts.tolist
    host = torch.empty(facts.shape, dtype=facts.dtype, pin_memory=True)
    host.copy_(facts, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return prefix, wait


def _uniform_prefix(facts: list[int], max_seq_len: int, is_causal: bool) -> int | None:
    """The prefix length ``P`` every sequence shares where the dense prefix gives each row what
    it must see, else None: every row sees the chunk as step 1 computed it (no view shorter
    than a sequence, mask rows the check found causal over the chunk) and either the prefix is
    empty or every row sees all of it (not ``is_causal``, whose top-left order hides it; mask
    rows that show it: the flags' least value has both bits, as every row's then has).

    Args:
        facts: :func:`_prefix_facts`' values.
        max_seq_len: the view's length.
        is_causal: the call's ``is_causal``.
    """
    longest_prefix, shortest_prefix, longest, *least_flag = facts
    # every row both causal over the chunk and showing the prefix (vacuous when it is empty)
    rows_ok = not least_flag or least_flag[0] == CAUSAL_OVER_CHUNK | SHOWS_PREFIX
    if longest > max_seq_len or longest_prefix != shortest_prefix or not rows_ok:
        return None
    if longest_prefix and is_causal:
        return None
    return longest_prefix
