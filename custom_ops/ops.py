"""The ``torch.ops.tq`` operators: schemas, fake (meta) implementations and device dispatch.

Every op validates its inputs first (:mod:`custom_ops.validate`), in the real and in the fake
implementation, so bad input raises before any kernel runs, eagerly and while tracing. CUDA
tensors run the Triton kernels; CPU tensors run the pure-torch reference, or the same Triton
kernels under ``TRITON_INTERPRET=1`` inside :func:`triton_on_cpu` (how the tests exercise the
kernels without a GPU).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from triton import knobs

from custom_ops import reference, validate
from custom_ops.formats import PagedKVCache
from custom_ops.triton import decode as triton_decode
from custom_ops.triton import dequant as triton_dequant
from custom_ops.triton import store as triton_store

__all__ = ["store", "dequantize", "decode", "triton_on_cpu"]

_state = threading.local()


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the ops' Triton kernels on CPU tensors (needs ``TRITON_INTERPRET=1`` at import)."""
    if not knobs.runtime.interpret:
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1 set before triton kernels "
            "are defined (before importing custom_ops)"
        )
    previous = getattr(_state, "triton_on_cpu", False)
    _state.triton_on_cpu = True
    try:
        yield
    finally:
        _state.triton_on_cpu = previous


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or (
        device.type == "cpu" and getattr(_state, "triton_on_cpu", False)
    )


@torch.library.custom_op("tq::store", mutates_args=("k_codes", "v_codes", "meta"))
def store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    meta: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    fmt: str,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hk, D]`` (bf16/fp16) into the slots of a paged cache.

    Args:
        key, value: ``[N, Hk, D]`` new token-heads, any strides.
        k_codes, v_codes, meta: the cache planes (see :mod:`custom_ops.formats`), mutated.
        slot_mapping: ``[N] int32`` slot of each token (``page * page_size + offset``);
            negative slots are padding and skipped.
        rotation: ``[D, D] float32`` +-1 rotation (:func:`custom_ops.codebook.rotation_matrix`).
        codebooks: ``[2, 16] float32`` levels (:func:`custom_ops.codebook.codebook_table`).
        fmt: format name (:data:`custom_ops.formats.FORMATS`).
    """
    cache = PagedKVCache(k_codes, v_codes, meta)
    kv_format = validate.check_store(fmt, key, value, cache, slot_mapping, rotation, codebooks)
    impl = triton_store.store if _use_triton(key.device) else reference.store
    impl(kv_format, key, value, cache, slot_mapping, rotation, codebooks)


@store.register_fake
def _store_fake(key, value, k_codes, v_codes, meta, slot_mapping, rotation, codebooks, fmt):
    validate.check_store(
        fmt, key, value, PagedKVCache(k_codes, v_codes, meta), slot_mapping, rotation, codebooks
    )


@torch.library.custom_op("tq::dequantize", mutates_args=())
def dequantize(
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    fmt: str,
    max_seq_len: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize a paged cache into dense K and V ``[B, Hk, max_seq_len, D]`` of ``dtype``.

    Args:
        k_codes, v_codes, meta: the cache planes.
        block_table: ``[B, max_pages] int32`` page ids of each sequence.
        seq_lens: ``[B] int32`` lengths; positions at or beyond them come out as zeros.
        rotation, codebooks, fmt: as for :func:`store`.
        max_seq_len: static length S of the output (at most ``max_pages * page_size``).
        dtype: output dtype (bf16, fp16, fp32 or fp64).
    """
    kv_format, cache, _ = validate.check_dequantize(
        k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt, max_seq_len, dtype
    )
    impl = triton_dequant.dequantize if _use_triton(k_codes.device) else reference.dequantize
    return impl(kv_format, cache, block_table, seq_lens, rotation, codebooks, max_seq_len, dtype)


@dequantize.register_fake
def _dequantize_fake(
    k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt, max_seq_len, dtype
):
    _, _, head_dim = validate.check_dequantize(
        k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt, max_seq_len, dtype
    )
    shape = (block_table.shape[0], k_codes.shape[1], max_seq_len, head_dim)
    return k_codes.new_empty(shape, dtype=dtype), k_codes.new_empty(shape, dtype=dtype)


@torch.library.custom_op("tq::decode", mutates_args=())
def decode(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    meta: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    fmt: str,
    num_splits: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its compressed, paged cache.

    Args:
        q: ``[B, Hq, D]`` bf16/fp16 queries; ``Hq`` a multiple of the cache's ``Hk`` (GQA).
        k_codes, v_codes, meta: the cache planes.
        block_table: ``[B, max_pages] int32`` page ids; seq_lens: ``[B] int32`` lengths (a
            sequence of length 0 gives zeros).
        rotation, codebooks, fmt: as for :func:`store`.
        num_splits: fixed number of KV splits (a power of two), chosen once per cache.
        scale: softmax scale (``1 / sqrt(D)`` for standard attention).
        mask: optional ``[B or 1, Hq or 1, M]`` attention mask over cache positions: bool
            (False masks out) or additive float (added to the scaled scores); positions
            ``>= M`` are masked out. A query with no visible key gets zeros.

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    cache = PagedKVCache(k_codes, v_codes, meta)
    kv_format = validate.check_decode(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, scale, mask
    )
    if _use_triton(q.device):
        return triton_decode.decode(
            kv_format,
            q,
            cache,
            block_table,
            seq_lens,
            rotation,
            codebooks,
            num_splits,
            scale,
            mask,
        )
    return reference.decode(
        kv_format,
        q,
        cache,
        block_table,
        seq_lens,
        rotation,
        codebooks,
        scale,
        torch.float32,
        mask,
    )


@decode.register_fake
def _decode_fake(
    q,
    k_codes,
    v_codes,
    meta,
    block_table,
    seq_lens,
    rotation,
    codebooks,
    fmt,
    num_splits,
    scale,
    mask=None,
):
    cache = PagedKVCache(k_codes, v_codes, meta)
    validate.check_decode(
        fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits, scale, mask
    )
    return torch.empty_like(q)
