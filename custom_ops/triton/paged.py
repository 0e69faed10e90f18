"""How the kernels address a paged cache: argument tuples, and the rows of a slot.

Kernels take a paged cache as a few tuple arguments instead of a dozen pointers and strides
each (Triton flattens tuples into separate kernel parameters and specializes each one):

* ``planes = (k_codes, v_codes, meta, k strides, value-row strides, meta strides)``: the three
  planes and their ``(page, head, slot)`` strides, value codes through the token-major
  :attr:`~custom_ops.formats.PagedKVCache.value_rows` view (slot stride 1, bytes ``page_size``
  apart);
* ``table = (block_table, stride_b, stride_p)``;
* ``mask_args = (mask, stride_b, stride_h, stride_t, mask_len)``: an attention mask over cache
  positions, its broadcast dimensions given zero strides;
* ``rings = (k_window, v_window, window_pos, stride_b, stride_h, stride_slot)``: the
  recent-window rings ``[>= B, Hk, W + sinks, D]`` and their slots' positions ``window_pos [>=
  B, Hk, W + sinks] int32``, all contiguous, so a ring row's offset divided by ``D`` is its
  slot's (slots: :func:`custom_ops.formats.ring_window`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it beside every jit function)

from custom_ops.formats import PagedKVCache, RecentWindow
from custom_ops.triton.traced import unread

__all__ = [
    "plane_arguments",
    "table_arguments",
    "ring_arguments",
    "mask_arguments",
    "row_pointers",
    "ring_start",
    "ring_run_length",
    "ring_run_positions",
    "ring_slots",
]


def plane_arguments(cache: PagedKVCache) -> tuple:
    """The ``planes`` tuple of ``cache``: the planes, then the page, head and slot strides of
    the key codes, of the value-code rows (:attr:`PagedKVCache.value_rows`, ``v_codes`` with
    its last two dims swapped: read off ``v_codes``' strides, no view made per launch) and of
    the meta records."""
    v_page, v_head, v_byte, v_slot = cache.v_codes.stride()
    return (*cache, *cache.k_codes.stride()[:3], v_page, v_head, v_slot, *cache.meta.stride()[:3])


def table_arguments(block_table: torch.Tensor) -> tuple:
    """The ``table`` tuple of ``block_table [B, max_pages] int32``."""
    return (block_table, *block_table.stride())


def ring_arguments(window: RecentWindow) -> tuple:
    """The ``rings`` tuple of ``window``: ``k_window``, ``v_window [>= B, Hk, W + sinks, D]``,
    ``window_pos`` (all contiguous) and the rings' batch, head and slot strides."""
    return (window.k_window, window.v_window, window.window_pos, *window.k_window.stride()[:3])


def mask_arguments(mask: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """The ``mask_args`` tuple of ``mask``: ``[B or 1, Hq or 1, M]`` (every query token) or ``[B
    or 1, Hq or 1, T, M]``, broadcast by zero strides, its last dim made contiguous; without a
    mask, ``placeholder``, never read (:func:`~custom_ops.triton.traced.unread`). The mask
    itself is passed, not a view of it: a graph traced for inductor may count every argument of
    a launch as written (see :mod:`custom_ops.triton.traced`), and a written view has to be
    written back."""
    if mask is None:
        return unread(placeholder), 0, 0, 0, 0
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    stride_b, stride_h = (mask.stride(i) if mask.shape[i] > 1 else 0 for i in (0, 1))
    stride_t = mask.stride(2) if mask.dim() == 4 else 0
    return mask, stride_b, stride_h, stride_t, mask.shape[-1]


@triton.jit
def row_pointers(planes, page, head, slot):
    """``(k_row, v_row, m_row)``: byte 0 of the key-code row and of the value-code row (its
    bytes ``page_size`` apart) and the meta record of token-heads ``(page, head, slot)`` (int64
    tensors of one shape)."""
    (
        k_codes,
        v_codes,
        meta,
        kc_page,
        kc_head,
        kc_slot,
        vc_page,
        vc_head,
        vc_slot,
        m_page,
        m_head,
        m_slot,
    ) = planes
    k_row = k_codes + page * kc_page + head * kc_head + slot * kc_slot
    v_row = v_codes + page * vc_page + head * vc_head + slot * vc_slot
    m_row = meta + page * m_page + head * m_head + slot * m_slot
    return k_row, v_row, m_row


@triton.jit
def ring_start(pos_ptr, seq_len, window, BLOCK: tl.constexpr = 128):
    """Where a sequence-head's ring run starts: the least position below ``seq_len`` that its
    ``window`` slots' positions ``pos_ptr [W] int32`` hold, ``seq_len`` if none (the kernels'
    copy of :func:`custom_ops.reference.ring_start`). Positions below it are in the pages, the
    run up to ``seq_len`` in the ring."""
    first = seq_len
    for r0 in range(0, window, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        held = tl.load(pos_ptr + r, mask=r < window, other=-1)
        in_run = (held >= 0) & (held < seq_len)
        first = tl.minimum(first, tl.min(tl.where(in_run, held, seq_len), axis=0))
    return first


@triton.jit
def ring_run_length(first, seq_len, SINKS: tl.constexpr):
    """Places in a sequence-head's ring run: its window's positions ``[first, seq_len)`` (from
    :func:`ring_start`), then its sinks, ``[0, min(SINKS, seq_len))``."""
    return seq_len - first + tl.minimum(seq_len, SINKS)


@triton.jit
def ring_run_positions(run, first, seq_len, SINKS: tl.constexpr):
    """The positions of places ``run`` of a ring run (:func:`ring_run_length`)."""
    if SINKS > 0:
        window_len = seq_len - first
        return tl.where(run < window_len, first + run, run - window_len)
    return first + run


@triton.jit
def ring_slots(positions, window, SINKS: tl.constexpr):
    """The ring slots of ``positions`` held in a ring of ``window`` slots and ``SINKS`` sinks:
    ``p % window``, a sink's (``p < SINKS``) ``window + p`` (the reference's copy:
    :func:`custom_ops.reference.ring_slots`)."""
    if SINKS > 0:
        return tl.where(positions < SINKS, window + positions, positions % tl.maximum(window, 1))
    return positions % window
