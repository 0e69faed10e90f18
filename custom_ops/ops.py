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

__all__ = ["store", "store_window", "dequantize", "decode", "triton_on_cpu"]

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


@torch.library.custom_op(
    "tq::store_window", mutates_args=("k_codes", "v_codes", "meta", "k_window", "v_window")
)
def store_window(
    key: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    meta: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
    codebooks: torch.Tensor,
    fmt: str,
) -> None:
    """Append new tokens to sequences that keep their most recent ``W`` tokens in full precision.

    The ring ``k_window``/``v_window`` holds each sequence's last ``min(len, W)`` tokens (position
    ``p`` at slot ``p % W``); the paged cache holds the older ones, quantized. New tokens go into
    the ring; tokens that leave it are quantized into their slots, exactly once (see
    :func:`custom_ops.reference.store_window`).

    Args:
        key, value: ``[B, Hk, T, D]`` (bf16/fp16, any strides) new tokens of each sequence.
        k_codes, v_codes, meta: the cache planes, mutated.
        k_window, v_window: ``[>= B, Hk, W, D]`` contiguous bf16/fp16 rings, mutated.
        block_table: ``[>= B, max_pages] int32`` page ids of each sequence; pages are needed
            only below ``len - W``, so a sequence holds ``max_pages * page_size + W`` positions.
        start_pos: ``[B] int32`` current length of each sequence = position of its first new
            token (tokens are appended; a negative start skips the sequence).
        rotation, codebooks, fmt: as for :func:`store`.
    """
    cache = PagedKVCache(k_codes, v_codes, meta)
    kv_format = validate.check_store_window(
        fmt, key, value, cache, k_window, v_window, block_table, start_pos, rotation, codebooks
    )
    impl = triton_store.store_window if _use_triton(key.device) else reference.store_window
    impl(kv_format, key, value, cache, k_window, v_window, block_table, start_pos, rotation,
         codebooks)  # fmt: skip


@store_window.register_fake
def _store_window_fake(key, value, k_codes, v_codes, meta, k_window, v_window, block_table,
                       start_pos, rotation, codebooks, fmt):  # fmt: skip
    validate.check_store_window(
        fmt, key, value, PagedKVCache(k_codes, v_codes, meta), k_window, v_window, block_table,
        start_pos, rotation, codebooks,
    )  # fmt: skip


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
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize a paged cache into dense K and V ``[B, Hk, max_seq_len, D]`` of ``dtype``.

    Args:
        k_codes, v_codes, meta: the cache planes.
        block_table: ``[B, max_pages] int32`` page ids of each sequence.
        seq_lens: ``[B] int32`` lengths; positions at or beyond them come out as zeros.
        rotation, codebooks, fmt: as for :func:`store`.
        max_seq_len: static length S of the output (at most ``max_pages * page_size``).
        dtype: output dtype (bf16, fp16, fp32 or fp64).
        k_window, v_window: optional ``[>= B, Hk, W, D]`` recent-window rings (see
            :func:`store_window`): each sequence's last ``min(len, W)`` positions come from them.
    """
    args = (k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt, max_seq_len,
            dtype, k_window, v_window)  # fmt: skip
    kv_format, cache, _ = validate.check_dequantize(*args)
    impl = triton_dequant.dequantize if _use_triton(k_codes.device) else reference.dequantize
    return impl(kv_format, cache, block_table, seq_lens, rotation, codebooks, max_seq_len, dtype,
                k_window, v_window)  # fmt: skip


@dequantize.register_fake
def _dequantize_fake(k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt,
                     max_seq_len, dtype, k_window=None, v_window=None):  # fmt: skip
    _, _, head_dim = validate.check_dequantize(
        k_codes, v_codes, meta, block_table, seq_lens, rotation, codebooks, fmt, max_seq_len,
        dtype, k_window, v_window,
    )  # fmt: skip
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
    k_window: torch.Tensor | None = None,
    v_window: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its compressed, paged cache.

    Args:
        q: ``[B, Hq, D]`` bf16/fp16 queries; ``Hq`` a multiple of the cache's ``Hk`` (GQA).
        k_codes, v_codes, meta: the cache planes.
        block_table: ``[B, max_pages] int32`` page ids (entries past a sequence's pages may
            hold anything: short contexts read them early, but never follow them); seq_lens:
            ``[B] int32`` lengths (a sequence of length 0 gives zeros).
        rotation, codebooks, fmt: as for :func:`store` (for a power-of-two D the CUDA kernels
            use the Walsh-Hadamard structure of ``rotation_matrix``: ``R = diag(s) @ H``).
        num_splits: fixed number of KV splits (a power of two), chosen once per cache.
        scale: softmax scale (``1 / sqrt(D)`` for standard attention).
        mask: optional ``[B or 1, Hq or 1, M]`` attention mask over cache positions: bool
            (False masks out) or additive float (added to the scaled scores); positions
            ``>= M`` are masked out. A query with no visible key gets zeros.
        k_window, v_window: optional ``[>= B, Hk, W, D]`` recent-window rings (see
            :func:`store_window`): the last ``min(len, W)`` positions are read from them in
            full precision, the older ones from the compressed cache.

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    cache = PagedKVCache(k_codes, v_codes, meta)
    kv_format = validate.check_decode(fmt, q, cache, block_table, seq_lens, rotation, codebooks,
                                      num_splits, scale, mask, k_window, v_window)  # fmt: skip
    if _use_triton(q.device):
        return triton_decode.decode(kv_format, q, cache, block_table, seq_lens, rotation,
                                    codebooks, num_splits, scale, mask, k_window,
                                    v_window)  # fmt: skip
    return reference.decode(kv_format, q, cache, block_table, seq_lens, rotation, codebooks,
                            scale, torch.float32, mask, k_window, v_window)  # fmt: skip


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
    k_window=None,
    v_window=None,
):
    cache = PagedKVCache(k_codes, v_codes, meta)
    validate.check_decode(fmt, q, cache, block_table, seq_lens, rotation, codebooks, num_splits,
                          scale, mask, k_window, v_window)  # fmt: skip
    return torch.empty_like(q)
