"""Key centering on CUDA: set each sequence-head's key centre before ``tq.store_window`` writes.

Every key a sequence-head holds is stored minus one vector ``mu`` (``key_center [B, Hk, D]
float32``), which may change only while none of its positions is in a page: the write that
first sends positions to pages sets it to the mean of the keys of positions ``[sinks, sinks +
max(W, 1))`` and re-centres the ring on it; a write from position 0 resets it to 0
(:func:`custom_ops.reference.center_keys`, the specification). The window store then subtracts
it from every key it writes (``CENTER`` in :mod:`custom_ops.triton.store_window`).

One program per sequence-head, launched before the window store of more than one token (a
prefill chunk, a verify step) or without a window; for one new token with a window (a decode
step) the window store sets the centres itself (``CENTER_INLINE``), one launch fewer per layer
and step. Almost every call reads the start and the ring's ``W`` positions and writes nothing;
the mean and the re-centring run once per sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from custom_ops.formats import RecentWindow
from custom_ops.triton.launch import KeyedMemo, Launcher
from custom_ops.triton.paged import ring_start

__all__ = ["center_keys_kernel", "center_keys", "ring_sample_sum", "recenter_ring"]

# ring slots or new tokens per step of the kernel's loops
_BLOCK = 32


@triton.jit
def ring_sample_sum(
    k_window_ptr,
    pos_ptr,
    ring_base,
    stride_w_slot,
    rows,
    start,
    old,
    window,
    SINKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """For sequence-heads ``rows [R]`` (bool) whose rings start at element ``ring_base [R]``
    (int64): the sum ``[R, D_PAD]`` float32 and the count ``[R]`` int32 of the keys that their
    ``window`` window slots hold of the centre's sample positions ``[SINKS, SINKS + window)``
    below ``start [R]``, un-centred (stored plus their centre ``old [R, D_PAD]``)."""
    d = tl.arange(0, D_PAD)[None, :]
    total = tl.zeros_like(old)
    count = tl.zeros_like(start)
    for s in range(0, window):
        held = tl.load(pos_ptr + ring_base // D + s, mask=rows, other=-1)
        sample = (held >= SINKS) & (held < start) & (held < SINKS + window)
        ring = tl.load(
            k_window_ptr + ring_base[:, None] + s * stride_w_slot + d,
            mask=sample[:, None] & (d < D),
            other=0.0,
        )
        total += tl.where(sample[:, None], ring.to(tl.float32) + old, 0.0)
        count += sample.to(tl.int32)
    return total, count


@triton.jit
def recenter_ring(
    k_window_ptr,
    pos_ptr,
    ring_base,
    stride_w_slot,
    rows,
    start,
    old,
    new,
    num_slots,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Re-centre the live slots (positions in ``[0, start)``) of the rings of ``num_slots``
    slots (window and sinks) of sequence-heads ``rows [R]``: stored key plus the old centre
    ``old [R, D_PAD]``, minus the new one ``new``, rounded to the ring's dtype."""
    d = tl.arange(0, D_PAD)[None, :]
    for s in range(0, num_slots):
        held = tl.load(pos_ptr + ring_base // D + s, mask=rows, other=-1)
        moved = (rows & (held >= 0) & (held < start))[:, None] & (d < D)
        slot_rows = k_window_ptr + ring_base[:, None] + s * stride_w_slot + d
        ring = tl.load(slot_rows, mask=moved).to(tl.float32)
        tl.store(slot_rows, (ring + old - new).to(k_window_ptr.dtype.element_ty), mask=moved)


@triton.jit
def center_keys_kernel(
    key_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    k_window_ptr,
    pos_ptr,
    stride_w_b,
    stride_w_h,
    stride_w_slot,
    center_ptr,
    start_pos_ptr,
    stride_start,
    num_kv_heads,
    num_new,
    window,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SINKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Sequence-head ``(b, head)`` = program: reset its centre at a write from position 0; at
    the write that sends its first positions to pages, set the centre to the sample's mean and
    re-centre the ring's live slots (positions below the start) on it. Its row is a batch of
    one for the helpers the window store shares."""
    b = tl.program_id(0) // num_kv_heads
    head = tl.program_id(0) % num_kv_heads
    start = tl.load(start_pos_ptr + b * stride_start)
    start = tl.where(start >= 0, tl.minimum(start, 2**31 - 1), -1).to(tl.int32)
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)
    ring_base = b64 * stride_w_b + head64 * stride_w_h  # element offset of slot 0

    # the least live position in the window slots (the start if none): pages hold [SINKS, it)
    paged_to = ring_start(pos_ptr + ring_base // D, start, window, BLOCK)
    freeze = (start >= 0) & (paged_to <= SINKS) & (start + num_new - window > SINKS)
    restart = start == 0

    d = tl.arange(0, D_PAD)[None, :]
    d_ok = d < D
    center_row = center_ptr + (b64 * num_kv_heads + head64) * D + d  # [1, D_PAD]
    if freeze | restart:
        old = tl.load(center_row, mask=d_ok & ~restart, other=0.0)
        mean = old
        if freeze:
            one = tl.zeros([1], dtype=tl.int32)  # the helpers' batch of one row
            rows, starts, bases = one == 0, one + start, one.to(tl.int64) + ring_base
            samples = tl.maximum(window, 1)
            # the sample's positions still in the ring (below the start), un-centred
            total, count = ring_sample_sum(
                k_window_ptr,
                pos_ptr,
                bases,
                stride_w_slot,
                rows,
                starts,
                old,
                window,
                SINKS,
                D,
                D_PAD,
            )
            # and the new tokens' (token t at position start + t)
            src = key_ptr + b64 * stride_kb + head64 * stride_kh
            lo = tl.maximum(SINKS - start, 0)
            hi = tl.minimum(num_new, SINKS + samples - start)
            for first in range(lo, hi, BLOCK):
                token = (first + tl.arange(0, BLOCK))[:, None]
                new = tl.load(
                    src + token.to(tl.int64) * stride_kt + d * stride_kd, mask=(token < hi) & d_ok
                )
                total += tl.sum(tl.where(token < hi, new.to(tl.float32), 0.0), axis=0)[None, :]
                count += tl.sum((token < hi).to(tl.int32))
            mean = total / tl.maximum(count, 1).to(tl.float32)[:, None]
            # re-centre every live slot, sinks included
            recenter_ring(
                k_window_ptr,
                pos_ptr,
                bases,
                stride_w_slot,
                rows,
                starts,
                old,
                mean,
                window + SINKS,
                D,
                D_PAD,
            )
        tl.store(center_row, mean, mask=d_ok)


@functools.lru_cache(maxsize=64)
def _launcher(head_dim: int, sinks: int) -> Launcher:
    return Launcher(
        center_keys_kernel,
        dict(
            D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            SINKS=sinks,
            BLOCK=_BLOCK,
            num_warps=4,
        ),
    )


# launchers of op calls by their arguments' metadata key
_LAUNCHERS = KeyedMemo()


def center_keys(
    key: torch.Tensor,
    window: RecentWindow,
    start_pos: torch.Tensor,
    launch_key: Hashable | None = None,
) -> None:
    """Update ``window.key_center [>= B, Hk, D] float32`` (and re-centre the ring
    ``window.k_window [>= B, Hk, W + sinks, D]`` where it is set) before the window store
    writes ``key [B, Hk, T, D]`` from ``start_pos [B]`` on; see
    :func:`custom_ops.reference.center_keys` (inputs validated by the op). ``launch_key``: the
    launcher's specialization key."""
    batch, num_kv_heads, n_new, head_dim = key.shape
    if batch == 0 or n_new == 0:
        return
    launcher = _LAUNCHERS.get(launch_key, lambda: _launcher(head_dim, window.sinks))
    launcher(
        (batch * num_kv_heads,),
        key,
        *key.stride(),
        window.k_window,
        window.window_pos,
        *window.k_window.stride()[:3],
        window.key_center,
        start_pos,
        start_pos.stride(0),
        num_kv_heads,
        n_new,
        window.size,
        key=launch_key,
    )
