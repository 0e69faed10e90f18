"""``tq.store_window`` on CUDA: write tokens to sequences that keep their most recent ``W``
tokens (and their first ``sinks``) in full-precision rings, quantizing each token that leaves a
ring into its page.

One launch of ``store_window_kernel`` over ``B * min(T, max(W, sinks)) * Hk`` rows moves every
token that leaves the ring into the paged cache and writes the ring and the sinks. When ``T >
W`` the first ``T - W`` new tokens never enter the ring: one more launch of the plain store
kernel (:mod:`custom_ops.triton.store`) quantizes those that are not sinks straight into their
slots (computed on the device from ``start_pos``). The two launches touch disjoint memory.
With key centering, the centring kernel (:mod:`custom_ops.triton.center`) runs first, except
for one new token with a window, where the window store sets the centres itself; the keys that
skip the ring are centred by torch ops before their store.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from custom_ops.formats import KVFormat, PagedKVCache, RecentWindow
from custom_ops.reference import written_lengths
from custom_ops.triton.center import center_keys, recenter_ring, ring_sample_sum
from custom_ops.triton.encode import encode_side
from custom_ops.triton.launch import KeyedMemo, Launcher
from custom_ops.triton.paged import plane_arguments, ring_arguments, row_pointers, table_arguments
from custom_ops.triton.planes import CodecParams
from custom_ops.triton.store import side_params, store

__all__ = [
    "store_window_kernel",
    "append_rows",
    "token_arguments",
    "EVICT",
    "FILL",
    "narrowed_start",
    "store_window",
    "APPEND_LAUNCH",
    "INTERPRETED_APPEND_LAUNCH",
    "PREFILL_LAUNCH",
    "APPEND_MAX_ROWS",
]

# (rows per program, warps) of the window store: appends (at most APPEND_MAX_ROWS rows, a decode
# step or a verify step) take one row per one-warp program, so each program's chain of loads
# and quantizing is as short as it gets (ring full, H200: 4bit_nc B1 5.0 -> 3.7 us, tq3_nc B64
# 10.5 -> 5.0 us against 16 rows on 4 warps; docs/design/cache.md, the store); prefill
# chunks take 32 rows on 4 warps. Triton's interpreter (CPU) runs a launch's programs one after
# another in Python: there appends keep 16 rows on 4 warps (one row per program made the store
# tests 5x slower); the bytes written do not depend on the shape (test_store_window.py checks
# APPEND_LAUNCH against the reference on the CPU too).
APPEND_LAUNCH = (1, 1)
INTERPRETED_APPEND_LAUNCH = (16, 4)
PREFILL_LAUNCH = (32, 4)
APPEND_MAX_ROWS = 4096
# append_rows' phases: the leaving token into its page, then the new tokens into the ring
EVICT = tl.constexpr(1)
FILL = tl.constexpr(2)


@triton.jit
def narrowed_start(start):
    """A start position (int32 or int64) as int32: negative ones, which skip a sequence, stay
    negative (-2**32 would become 0), large ones saturate."""
    return tl.where(start >= 0, tl.minimum(start, 2**31 - 1), -1).to(tl.int32)


@triton.jit
def store_window_kernel(
    tokens,
    rings,
    planes,
    table,
    start_pos_ptr,
    stride_start,
    seq_lens_ptr,
    rot_ptr,
    center_ptr,
    num_rows,
    num_kv_heads,
    num_new,
    num_chains,
    window,
    page_size,
    max_pages,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    SINKS: tl.constexpr,
    CENTER: tl.constexpr,
    CENTER_INLINE: tl.constexpr,
):
    """``BLOCK_R`` rows of :func:`append_rows` per program (``tokens``: the new keys and
    values and their strides, :func:`token_arguments`)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    append_rows(
        rows,
        rows < num_rows,
        tokens,
        rings,
        planes,
        table,
        start_pos_ptr,
        stride_start,
        seq_lens_ptr,
        rot_ptr,
        center_ptr,
        num_kv_heads,
        num_new,
        num_chains,
        window,
        page_size,
        max_pages,
        D,
        D_PAD,
        INV_SQRT_D,
        BLOCK_R,
        K,
        V,
        SINKS,
        CENTER,
        CENTER_INLINE,
    )


@triton.jit
def append_rows(
    rows,
    in_range,
    tokens,
    rings,
    planes,
    table,
    start_pos_ptr,
    stride_start,
    seq_lens_ptr,
    rot_ptr,
    center_ptr,
    num_kv_heads,
    num_new,
    num_chains,
    window,
    page_size,
    max_pages,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    SINKS: tl.constexpr,
    CENTER: tl.constexpr,
    CENTER_INLINE: tl.constexpr,
    # EVICT | FILL, both (a literal: inductor's generated module evaluates the defaults)
    PHASES: tl.constexpr = 3,
):
    """Row ``(b, chain, head)`` (``rows [BLOCK_R]``, those ``in_range``): ring slot ``(start +
    chain) % W`` of sequence ``b`` (chains below ``W``). Its old token is quantized into its
    page if still part of the sequence (its position, from ``window_pos``, below ``start``);
    then the last new token of the chain
    ``chain, chain + W, ...`` takes the slot, unless its position is a sink's. New token
    ``chain`` at a sink's position (below ``SINKS``) takes that sink's slot ``W + start +
    chain``. Each row owns its slots and position entries, so no row reads what another
    writes. Row ``(b, 0, 0)`` also writes the sequence's new length (0 if skipped). With
    ``CENTER`` every new key is written minus its sequence-head's centre (``center_ptr [B, Hk,
    D] float32``, which :mod:`custom_ops.triton.center` set before; the ring already holds
    centred keys, so a token leaving it is quantized as it is). ``CENTER_INLINE`` (one new
    token, a window): this kernel sets the centres itself, saving the centring launch of
    every decode step: a row whose leaving token is position ``SINKS`` (the first to reach a
    page) sets its centre from the window slots and re-centres the ring before quantizing it;
    a row at position 0 resets its centre.

    ``PHASES``: ``EVICT`` quantizes the leaving token into its page (reading the ring row and
    its position), ``FILL`` writes the new tokens into the ring and the sinks, their positions
    and the length; both, one after the other, by default. The decode step with its own token
    evicts in the split kernel (:mod:`custom_ops.triton.decode.split`, one row per program,
    beside the splits: none attends that page slot) and fills in the merge
    (:mod:`custom_ops.triton.decode.merge_fill`, after the whole split kernel)."""
    (
        key_ptr,
        value_ptr,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
    ) = tokens
    head = rows % num_kv_heads
    chain = (rows // num_kv_heads) % num_chains
    b = rows // (num_kv_heads * num_chains)
    start = narrowed_start(tl.load(start_pos_ptr + b * stride_start, mask=in_range, other=-1))
    live = in_range & (start >= 0)
    if PHASES != EVICT:
        tl.store(
            seq_lens_ptr + b,
            tl.where(live, start + num_new, 0),
            mask=in_range & (chain == 0) & (head == 0),
        )
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)
    k_window_ptr, v_window_ptr, pos_ptr, stride_w_b, stride_w_h, stride_w_slot = rings
    block_table_ptr, stride_bt_b, stride_bt_p = table
    in_ring = chain < window  # with sinks beyond the window, later chains only write sinks
    period = tl.maximum(window, 1)  # the window slots' period (none without a window)
    ring_slot = (tl.maximum(start, 0) + chain) % period
    ring_base = b64 * stride_w_b + head64 * stride_w_h
    ring_rows = ring_base + ring_slot.to(tl.int64) * stride_w_slot
    pos_rows = ring_rows // D  # the slot's window_pos entry (contiguous planes)

    # The chain's last new token (the only one of it that stays in the window), loaded first:
    # its loads do not wait for the start, so they overlap the eviction's chain of loads.
    newest = chain + period * ((num_new - 1 - chain) // period)
    d = tl.arange(0, D_PAD)[None, :]
    newest64 = newest.to(tl.int64)
    k_src = key_ptr + b64 * stride_kb + head64 * stride_kh + newest64 * stride_kt
    v_src = value_ptr + b64 * stride_vb + head64 * stride_vh + newest64 * stride_vt
    new_mask = (in_range & in_ring)[:, None] & (d < D)
    k_new = tl.load(k_src[:, None] + d * stride_kd, mask=new_mask)
    v_new = tl.load(v_src[:, None] + d * stride_vd, mask=new_mask)
    if CENTER:
        center_rows = center_ptr + (b64 * num_kv_heads + head64)[:, None] * D + d
        center = tl.load(center_rows, mask=in_range[:, None] & (d < D), other=0.0)
    # a sink's position never enters the window slots (nor leaves a sink slot)
    to_ring = live & in_ring & (start + newest >= SINKS)
    copy_mask = to_ring[:, None] & (d < D)

    if PHASES != FILL:
        # 1. quantize the token leaving the ring into its page slot: a rolled-back position (at or
        # past start) or an empty slot (-1) leaves nothing
        leaving = tl.load(pos_ptr + pos_rows, mask=to_ring, other=-1)
        page_index = tl.maximum(leaving, 0) // page_size
        evict = to_ring & (leaving >= 0) & (leaving < start) & (page_index < max_pages)
        if CENTER_INLINE:
            # (custom_ops.reference.center_keys for one new token: its centre is set when position
            # SINKS leaves, from the window slots, which then hold [SINKS, SINKS + W))
            restart = live & (start == 0)
            center = tl.where(restart[:, None], 0.0, center)
            tl.store(center_rows, center, mask=restart[:, None] & (d < D))
            freeze = evict & (leaving == SINKS)
            if tl.max(freeze.to(tl.int32), axis=0) > 0:
                total, count = ring_sample_sum(
                    k_window_ptr,
                    pos_ptr,
                    ring_base,
                    stride_w_slot,
                    freeze,
                    start,
                    center,
                    window,
                    SINKS,
                    D,
                    D_PAD,
                )
                mean = total / tl.maximum(count, 1).to(tl.float32)[:, None]
                tl.debug_barrier()
                recenter_ring(
                    k_window_ptr,
                    pos_ptr,
                    ring_base,
                    stride_w_slot,
                    freeze,
                    start,
                    center,
                    mean,
                    window + SINKS,
                    D,
                    D_PAD,
                )  # every live slot, sinks included
                center = tl.where(freeze[:, None], mean, center)
                tl.store(center_rows, center, mask=freeze[:, None] & (d < D))
                # the re-centred rows are written before the leaving token's is read
                tl.debug_barrier()
        page_ptr = block_table_ptr + b64 * stride_bt_b + page_index * stride_bt_p
        page = tl.load(page_ptr, mask=evict, other=0).to(tl.int64)
        slot = (tl.maximum(leaving, 0) % page_size).to(tl.int64)
        k_row, v_row, m_row = row_pointers(planes, page, head64, slot)
        encode_side(
            k_window_ptr, ring_rows, 1, evict, k_row, m_row, rot_ptr, K, D, INV_SQRT_D, BLOCK_R
        )
        encode_side(
            v_window_ptr, ring_rows, 1, evict, v_row, m_row, rot_ptr, V, D, INV_SQRT_D, BLOCK_R
        )
        if PHASES != EVICT:
            # Every thread's reads of the old ring rows happen before any thread overwrites them.
            tl.debug_barrier()

    if PHASES != EVICT:
        # 2. the new token loaded above takes the slot
        if CENTER:
            k_new = k_new.to(tl.float32) - center
        w_dst = ring_rows[:, None] + d
        tl.store(k_window_ptr + w_dst, k_new.to(k_window_ptr.dtype.element_ty), mask=copy_mask)
        tl.store(v_window_ptr + w_dst, v_new.to(v_window_ptr.dtype.element_ty), mask=copy_mask)
        tl.store(pos_ptr + pos_rows, start + newest, mask=to_ring)

        if SINKS > 0:
            # 3. new token `chain` at a sink's position takes the sink's slot (no other row reads
            # or writes it)
            to_sink = live & (start + chain < SINKS)
            chain64 = chain.to(tl.int64)
            sink_rows = ring_base + (window + start + chain).to(tl.int64) * stride_w_slot
            sink_mask = to_sink[:, None] & (d < D)
            k_sink = tl.load(
                key_ptr
                + (b64 * stride_kb + head64 * stride_kh + chain64 * stride_kt)[:, None]
                + d * stride_kd,
                mask=sink_mask,
            )
            v_sink = tl.load(
                value_ptr
                + (b64 * stride_vb + head64 * stride_vh + chain64 * stride_vt)[:, None]
                + d * stride_vd,
                mask=sink_mask,
            )
            if CENTER:
                k_sink = k_sink.to(tl.float32) - center
            tl.store(
                k_window_ptr + sink_rows[:, None] + d,
                k_sink.to(k_window_ptr.dtype.element_ty),
                mask=sink_mask,
            )
            tl.store(
                v_window_ptr + sink_rows[:, None] + d,
                v_sink.to(v_window_ptr.dtype.element_ty),
                mask=sink_mask,
            )
            tl.store(pos_ptr + sink_rows // D, start + chain, mask=to_sink)


@functools.lru_cache(maxsize=256)
def _launcher(
    key_params: CodecParams,
    value_params: CodecParams,
    head_dim: int,
    block_rows: int,
    num_warps: int,
    sinks: int,
    center: bool,
    center_inline: bool,
) -> Launcher:
    return Launcher(
        store_window_kernel,
        dict(
            D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            INV_SQRT_D=1.0 / math.sqrt(head_dim),
            BLOCK_R=block_rows,
            K=key_params,
            V=value_params,
            SINKS=sinks,
            CENTER=center,
            CENTER_INLINE=center_inline,
            num_warps=num_warps,
        ),
    )


def _launch(
    fmt: KVFormat,
    cache: PagedKVCache,
    head_dim: int,
    num_rows: int,
    block_rows: int | None,
    num_warps: int | None,
    sinks: int,
    center: bool,
    center_inline: bool,
) -> tuple[Launcher, tuple[int]]:
    """The window store's launcher and grid for ``num_rows`` rows (``block_rows`` and
    ``num_warps`` None: :data:`APPEND_LAUNCH`'s, :data:`INTERPRETED_APPEND_LAUNCH`'s off a GPU,
    or :data:`PREFILL_LAUNCH`'s)."""
    append = APPEND_LAUNCH if cache.k_codes.is_cuda else INTERPRETED_APPEND_LAUNCH
    default_rows, default_warps = append if num_rows <= APPEND_MAX_ROWS else PREFILL_LAUNCH
    block_rows = block_rows or default_rows
    num_warps = num_warps or default_warps
    launcher = _launcher(
        *side_params(fmt, cache, head_dim),
        head_dim,
        block_rows,
        num_warps,
        sinks,
        center,
        center_inline,
    )
    return launcher, (triton.cdiv(num_rows, block_rows),)


def token_arguments(key: torch.Tensor, value: torch.Tensor) -> tuple:
    """The ``tokens`` tuple of new keys and values ``[B, Hk, T, D]``: both, then their four
    strides each."""
    return (key, value, *key.stride(), *value.stride())


# (launcher, grid) of op calls by their arguments' metadata key
_LAUNCHES = KeyedMemo()


def store_window(
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    window: RecentWindow,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
    block_rows: int | None = None,
    num_warps: int | None = None,
    launch_key: Hashable | None = None,
) -> torch.Tensor:
    """Launch the window store (inputs validated; see ``torch.ops.tq.store_window``); the
    sequences' new lengths ``[B] int32``. With the window's ``key_center`` the centres are set
    first (:func:`custom_ops.triton.center.center_keys`) and every key is stored minus its
    centre.

    ``block_rows``, ``num_warps``: rows per program and its warps (each None: that of
    :data:`APPEND_LAUNCH` for appends on a GPU, of :data:`PREFILL_LAUNCH` for more rows);
    ``launch_key``: the launchers' specialization key (see
    :class:`~custom_ops.triton.launch.Launcher`)."""
    batch, num_kv_heads, n_new, head_dim = key.shape
    if batch == 0 or n_new == 0:
        return written_lengths(start_pos, n_new)
    key_center, sinks, size = window.key_center, window.sinks, window.size
    seq_lens = torch.empty(batch, dtype=torch.int32, device=key.device)
    page_size = cache.k_codes.shape[2]
    # one new token with a window: the store kernel sets the centres itself
    center_inline = key_center is not None and n_new == 1 and size > 0
    if key_center is not None and not center_inline:
        center_keys(key, window, start_pos, launch_key)
    if n_new > size:
        positions = start_pos[:, None].to(torch.int64) + torch.arange(
            n_new - size, device=key.device
        )  # [B, T - W]
        page_index = positions // page_size
        # sinks stay in the ring's sink slots (the kernel writes them)
        in_table = (start_pos[:, None] >= 0) & (page_index < block_table.shape[1])
        in_table &= positions >= sinks
        pages = block_table[:batch].gather(1, page_index.clamp(0, block_table.shape[1] - 1))
        slots = torch.where(in_table, pages * page_size + positions % page_size, -1)

        def rows_of(x):  # [B, Hk, T, D] -> [B * (T - W), Hk, D], in the slots' order
            return x[:, :, : n_new - size].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)

        # (centred keys are a new tensor: the op's launch key does not describe them)
        direct_keys = key
        if key_center is not None:  # [B, Hk, T - W, D] centred, rounded as the ring rounds
            centred = key[:, :, : n_new - size].float() - key_center[:batch, :, None]
            direct_keys = centred.to(window.k_window.dtype)
        store(
            fmt,
            rows_of(direct_keys),
            rows_of(value),
            cache,
            slots.reshape(-1).to(torch.int32),
            rotation,
            launch_key=None if key_center is not None else launch_key,
        )
    num_chains = min(n_new, max(size, sinks))
    num_rows = batch * num_chains * num_kv_heads
    # the memo holds the default launch shape's launches only
    defaults = block_rows is None and num_warps is None
    launcher, grid = _LAUNCHES.get(
        launch_key if defaults else None,
        lambda: _launch(
            fmt,
            cache,
            head_dim,
            num_rows,
            block_rows,
            num_warps,
            sinks,
            key_center is not None,
            center_inline,
        ),
    )
    launcher(
        grid,
        token_arguments(key, value),
        ring_arguments(window),
        plane_arguments(cache),
        table_arguments(block_table),
        start_pos,
        start_pos.stride(0),
        seq_lens,
        rotation,
        seq_lens if key_center is None else key_center,
        num_rows,
        num_kv_heads,
        n_new,
        num_chains,
        size,
        page_size,
        block_table.shape[1],
        key=launch_key,
    )
    return seq_lens
