"""Typed Python API over ``torch.ops.tq`` for the layers above: constants, store, dequantize."""

from __future__ import annotations

from typing import NamedTuple

import torch

from custom_ops.codebook import codebook_table, rotation_matrix
from custom_ops.formats import Kind, KVFormat, PagedKVCache, get_format

__all__ = ["KVConstants", "make_constants", "store", "dequantize"]


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


def dequantize(
    fmt: str | KVFormat,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    constants: KVConstants,
    max_seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[B, Hk, max_seq_len, D]`` of every sequence (zeros past its length)."""
    return torch.ops.tq.dequantize(
        *cache, block_table, seq_lens, *constants, get_format(fmt).name, max_seq_len, dtype
    )
