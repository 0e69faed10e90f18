"""Typed Python API over ``torch.ops.tq`` for the layers above: constants, store, decode.

Each wrapper builds the operator's argument tuple (:mod:`custom_ops.schema`) from a
:class:`~custom_ops.formats.PagedKVCache`, an optional
:class:`~custom_ops.formats.RecentWindow` and :class:`KVConstants`, fills in the defaults
(split count, softmax scale) by the policies every caller shares, and runs the operator
through :func:`custom_ops.ops.call` (in eager mode on CUDA, its implementation without the
dispatcher's round trip).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from custom_ops import ops, splits
from custom_ops.codebook import rotation_matrix
from custom_ops.formats import (
    KVFormat,
    PagedKVCache,
    RecentWindow,
    get_format,
    sequence_capacity,
    window_size,
)
from custom_ops.schema import (
    DecodeArgs,
    DecodeStepArgs,
    DequantizeArgs,
    PrefillArgs,
    StoreArgs,
    StoreWindowArgs,
    window_fields,
)
from custom_ops.triton.decode.plan import step_pays, step_supported

__all__ = [
    "KVConstants",
    "make_constants",
    "store",
    "store_window",
    "dequantize",
    "decode",
    "decode_step",
    "step_pays",
    "step_supported",
    "prefill",
    "default_num_splits",
    "appended_window_positions",
]


class KVConstants(NamedTuple):
    """The per-cache constants every op takes.

    Attributes:
        rotation: ``[D, D] float32`` +-1 rotation matrix (Lloyd-Max codecs rotate with it).
    """

    rotation: torch.Tensor


def make_constants(
    fmt: str | KVFormat, head_dim: int, seed: int = 0, device: torch.device | str = "cpu"
) -> KVConstants:
    """Build the seeded rotation for one head dim on ``device`` (the Lloyd-Max levels are not a
    constant of the cache: they follow from the format and the head dim)."""
    get_format(fmt)  # a clear error for an unknown format
    return KVConstants(rotation_matrix(head_dim, seed).to(device))


def store(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    constants: KVConstants,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hk, D]`` into ``cache`` at ``slot_mapping [N] int32``."""
    args = StoreArgs(key, value, *cache, slot_mapping, constants.rotation, get_format(fmt).name)
    ops.call(args)


def store_window(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    window: RecentWindow,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    constants: KVConstants,
) -> torch.Tensor:
    """Write ``key``/``value`` ``[B, Hk, T, D]`` at positions ``start_pos [B] ..`` (int32 or
    int64; at most each sequence's length) to sequences whose latest tokens (and first
    ``sinks``) live in ``window``'s rings (see ``torch.ops.tq.store_window``); the new lengths
    ``[B] int32``. With the window's ``key_center`` (zeros in a new cache) the keys are stored
    centred, the centres kept there."""
    args = StoreWindowArgs(
        key,
        value,
        *cache,
        block_table=block_table,
        start_pos=start_pos,
        rotation=constants.rotation,
        fmt=get_format(fmt).name,
        **window_fields(window, StoreWindowArgs),
    )
    return ops.call(args)


def appended_window_positions(
    seq_lens: torch.Tensor, num_kv_heads: int, window: int, sinks: int = 0
) -> torch.Tensor:
    """``window_pos [B, Hk, W + sinks] int32`` of rings that hold the last ``min(len, W)``
    positions of at least ``sinks`` of sequences of lengths ``seq_lens [B]`` (position ``p`` at
    slot ``p % W``) and their first ``min(len, sinks)`` (slot ``W + p``), -1 in the other slots:
    what appending up to those lengths leaves, for rings filled by other means (a benchmark's
    random rings, a cache restored from elsewhere)."""
    slots = torch.arange(window, device=seq_lens.device)[None, :]
    lens = seq_lens.to(torch.int64)[:, None]
    newest = lens - 1 - (lens - 1 - slots) % window  # the last position below len at each slot
    held = torch.where(newest >= sinks, newest, -1)
    sink_slots = torch.arange(sinks, device=seq_lens.device)[None, :]
    held = torch.cat([held, torch.where(sink_slots < lens, sink_slots, -1)], dim=1)
    return held.to(torch.int32)[:, None, :].expand(-1, num_kv_heads, -1).contiguous()


def dequantize(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    constants: KVConstants,
    max_seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    window: RecentWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[B, Hk, max_seq_len, D]`` of every sequence (zeros past its length; the
    ring runs and sinks from the window's rings when given; keys stored centred get the
    window's ``key_center`` back)."""
    args = DequantizeArgs(
        *cache,
        block_table,
        seq_lens,
        constants.rotation,
        get_format(fmt).name,
        max_seq_len,
        dtype,
        **window_fields(window, DequantizeArgs),
    )
    return ops.call(args)


def default_num_splits(
    batch: int,
    num_kv_heads: int,
    max_pages: int,
    page_size: int,
    window: int,
    device: torch.device | str,
) -> int:
    """The decode split count of a cache (:func:`custom_ops.splits.num_splits_for` of its
    sequence capacity, ``max_pages * page_size + window``): what :func:`decode` and
    ``TurboQuantKVCache`` use unless told otherwise."""
    capacity = sequence_capacity(max_pages, page_size, window)
    return splits.num_splits_for(batch, num_kv_heads, capacity, device)


def _cache_splits(q, cache: PagedKVCache, block_table, window: RecentWindow | None) -> int:
    """:func:`default_num_splits` of a decode of ``q`` over ``cache``."""
    return default_num_splits(
        q.shape[0],
        cache.k_codes.shape[1],
        block_table.shape[1],
        cache.k_codes.shape[2],
        window_size(window),
        q.device,
    )


def decode_step(
    fmt: str | KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    window: RecentWindow,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    constants: KVConstants,
    num_splits: int | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step with its own token: ``q [B, Hq, D]`` attends the cache as it was (the
    positions below ``start_pos``) and the step's ``key``/``value [B, Hk, 1, D]`` exactly, then
    the token is appended to the cache and ``window``; ``(out [B, Hq, D], new lengths [B]
    int32)``. Defaults as :func:`decode`'s.

    Raises:
        ValueError: a window whose keys are stored centred (``key_center``): the step's own key
            would be attended and stored without the centre; and what ``tq.decode_step``
            refuses.
    """
    if window.key_center is not None:
        raise ValueError(
            "decode_step: window.key_center is set (keys stored centred), which the fused step "
            "does not serve; use store_window and decode"
        )
    if num_splits is None:
        num_splits = _cache_splits(q, cache, block_table, window)
    args = DecodeStepArgs(
        q,
        key,
        value,
        *cache,
        block_table,
        start_pos,
        constants.rotation,
        get_format(fmt).name,
        num_splits,
        q.shape[-1] ** -0.5 if scale is None else scale,
        **window_fields(window, DecodeStepArgs),
        mask=mask,
        softcap=softcap,
    )
    return ops.call(args)


def decode(
    fmt: str | KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    constants: KVConstants,
    num_splits: int | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` (one token per sequence) over the cache: ``[B, Hq, D]``.

    ``num_splits`` defaults to :func:`default_num_splits`; ``scale`` to ``1 / sqrt(D)``;
    ``window`` is the recent window, if any (its ``key_center`` is not read: the keys' scores
    as stored differ by a shift that softmax ignores); ``softcap`` > 0 caps the scores (Gemma
    2's attention logit softcapping).
    """
    if num_splits is None:
        num_splits = _cache_splits(q, cache, block_table, window)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    args = DecodeArgs(
        q,
        *cache,
        block_table,
        seq_lens,
        constants.rotation,
        get_format(fmt).name,
        num_splits,
        scale,
        mask,
        **window_fields(window, DecodeArgs),
        softcap=softcap,
    )
    return ops.call(args)


def prefill(
    fmt: str | KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    constants: KVConstants,
    scale: float | None = None,
    is_causal: bool = False,
    max_seq_len: int | None = None,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of a chunk just stored, ``q [B, Hq, T, D]``, over its own exact ``key`` /
    ``value [B, Hk, T, D]`` and each sequence's cached prefix (the positions below
    ``seq_lens[b] - T``): ``[B, Hq, T, D]`` (see ``torch.ops.tq.prefill``), ``window`` its
    recent window, if any. ``scale`` defaults to ``1 / sqrt(D)``, ``max_seq_len`` to the
    sequences' capacity (nothing hidden past the lengths); ``softcap`` > 0 caps the scores."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if max_seq_len is None:
        max_seq_len = sequence_capacity(
            block_table.shape[1], cache.k_codes.shape[2], window_size(window)
        )
    args = PrefillArgs(
        q,
        key,
        value,
        *cache,
        block_table,
        seq_lens,
        constants.rotation,
        get_format(fmt).name,
        scale,
        is_causal,
        max_seq_len,
        mask,
        **window_fields(window, PrefillArgs),
        softcap=softcap,
    )
    return ops.call(args)
