"""Typed Python API over ``torch.ops.tq`` for the layers above: constants, store, dequantize."""

from __future__ import annotations

from typing import NamedTuple

import torch

from custom_ops.codebook import codebook_table, rotation_matrix
from custom_ops.formats import Kind, KVFormat, PagedKVCache, get_format
from custom_ops.triton.decode import choose_num_splits

__all__ = [
    "KVConstants",
    "make_constants",
    "store",
    "store_window",
    "dequantize",
    "decode",
    "num_splits_for",
]


class KVConstants(NamedTuple):
    """The per-format constants every op takes.

    Attributes:
        rotation: ``[D, D] float32`` +-1 rotation matrix (Lloyd-Max codecs rotate with it).
        codebooks: ``[2, 16] float32`` Lloyd-Max levels of keys (row 0) and values (row 1).
    """

    rotation: torch.Tensor
    codebooks: torch.Tensor


def make_constants(
    fmt: str | KVFormat, head_dim: int, seed: int = 0, device: torch.device | str = "cpu"
) -> KVConstants:
    """Build the rotation (seeded) and codebooks of a format for one head dim on ``device``."""
    kv_format = get_format(fmt)

    def lloyd_max_bits(codec):
        return codec.bits if codec.kind == Kind.LLOYD_MAX else None

    codebooks = codebook_table(
        lloyd_max_bits(kv_format.key), lloyd_max_bits(kv_format.value), head_dim
    )
    return KVConstants(rotation_matrix(head_dim, seed).to(device), codebooks.to(device))


def store(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    constants: KVConstants,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hk, D]`` into ``cache`` at ``slot_mapping [N] int32``."""
    torch.ops.tq.store(key, value, *cache, slot_mapping, *constants, get_format(fmt).name)


def store_window(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    constants: KVConstants,
) -> None:
    """Append ``key``/``value`` ``[B, Hk, T, D]`` at positions ``start_pos [B] int32 ..`` to
    sequences whose last ``W`` tokens live in the rings ``k_window``/``v_window [B, Hk, W, D]``
    (see ``torch.ops.tq.store_window``)."""
    torch.ops.tq.store_window(key, value, *cache, k_window, v_window, block_table, start_pos,
                              *constants, get_format(fmt).name)  # fmt: skip


def dequantize(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    constants: KVConstants,
    max_seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[B, Hk, max_seq_len, D]`` of every sequence (zeros past its length; the
    last ``W`` positions from the rings when given)."""
    return torch.ops.tq.dequantize(*cache, block_table, seq_lens, *constants,
                                   get_format(fmt).name, max_seq_len, dtype, k_window,
                                   v_window)  # fmt: skip


def num_splits_for(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str
) -> int:
    """The fixed split count for a cache of this capacity on ``device`` (1 on the CPU).

    Depends only on capacity and the GPU's SM count, never on current lengths, so it is chosen
    once per cache and a captured CUDA graph stays valid as sequences grow.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(batch, num_kv_heads, max_seq_len, sm_count)


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
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` (one token per sequence) over the cache: ``[B, Hq, D]``.

    ``num_splits`` defaults to :func:`num_splits_for` the block table's capacity; ``scale`` to
    ``1 / sqrt(D)``; ``k_window``/``v_window`` are the recent-window rings, if any.
    """
    if num_splits is None:
        capacity = block_table.shape[1] * cache.k_codes.shape[2]
        num_splits = num_splits_for(q.shape[0], cache.k_codes.shape[1], capacity, q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.tq.decode(
        q,
        *cache,
        block_table,
        seq_lens,
        *constants,
        get_format(fmt).name,
        num_splits,
        scale,
        mask,
        k_window,
        v_window,
    )
