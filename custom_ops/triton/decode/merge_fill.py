"""A decode step's merge (``tq.decode_step``): the log-sum-exp merge of
:mod:`custom_ops.triton.decode.merge`, and the step's token written into the ring.

The split kernel before it has attended the ring and moved the token leaving it into its page
(its eviction: programs of their own, or the last split's). The merge waits for that whole
kernel anyway (``griddepcontrol.wait`` under programmatic dependent launch, stream order
otherwise) before it reads a partial, so it can also write the step's token into the ring
slot the leaving token held: :func:`custom_ops.triton.store_window.append_rows`' ``FILL``
phase, ``FILL_ROWS`` sequence-heads per program of the first column block (grid axis 1:
:class:`~custom_ops.triton.decode.merge.MergeConfig`'s ``block_d``). An earlier version had
the last split program of each sequence-head fill, found by an atomic count; at B1 4k that
count and fill at the end of the split kernel cost 4-5 us per layer
(docs/notes/2026-11-29-first-graph.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from custom_ops.formats import RecentWindow
from custom_ops.triton.decode.merge import merge_arguments, merge_rows
from custom_ops.triton.decode.split import DecodeStep
from custom_ops.triton.paged import ring_arguments, table_arguments
from custom_ops.triton.store_window import FILL, append_rows, token_arguments

__all__ = [
    "merge_fill_kernel",
    "fill_rows_per_program",
    "merge_fill_arguments",
]


def fill_rows_per_program(sequence_heads: int, num_programs: int) -> int:
    """``FILL_ROWS``: the sequence-heads whose step token each of the merge's ``num_programs``
    programs along grid axis 0 (those of the first column block) writes into the ring (a power
    of two), so that they cover ``sequence_heads``."""
    return triton.next_power_of_2(triton.cdiv(sequence_heads, max(num_programs, 1)))


@triton.jit
def merge_fill_kernel(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    num_rows,
    tokens,
    rings,
    table,
    start_pos_ptr,
    stride_start,
    new_lens_ptr,
    num_kv_heads,
    window,
    sequence_heads,
    NUM_SPLITS: tl.constexpr,
    WINDOW_PARTS: tl.constexpr,
    WINDOW_PARTS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTATE_BACK: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    LOG2_D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PDL: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Write the step's token (``tokens``, ``[B, Hk, 1, D]``) of sequence-heads ``[pid *
    FILL_ROWS, (pid + 1) * FILL_ROWS)`` (of ``sequence_heads``, row ``b * Hk + head``) into the
    ring (``rings``, ``window`` slots and ``SINKS``), its position and the new lengths
    ``new_lens_ptr [B]``, at the positions ``start_pos_ptr``, in the first column block
    (grid axis 1); then :func:`merge_rows` of this program's rows and columns."""
    if PDL:
        gdc_wait()  # for every partial, and for the split kernel's reads of the ring
    fill_rows = tl.program_id(0) * FILL_ROWS + tl.arange(0, FILL_ROWS)
    append_rows(
        fill_rows,
        (fill_rows < sequence_heads) & (tl.program_id(1) == 0),
        tokens,
        rings,
        0,  # (the planes, the rotation, the page size and the codecs: the eviction's)
        table,
        start_pos_ptr,
        stride_start,
        new_lens_ptr,
        rot_ptr,
        new_lens_ptr,  # (no key centres)
        num_kv_heads,
        1,
        1,
        window,
        1,
        1,
        D,
        D_PAD,
        INV_SQRT_D,
        FILL_ROWS,
        None,
        None,
        SINKS,
        False,
        False,
        FILL,
    )
    merge_rows(
        part_out_ptr,
        part_lse_ptr,
        rot_ptr,
        out_ptr,
        num_rows,
        NUM_SPLITS,
        WINDOW_PARTS,
        WINDOW_PARTS_PAD,
        SPLIT_CHUNK,
        BLOCK_M,
        BLOCK_D,
        ROTATE_BACK,
        D,
        D_PAD,
        LOG2_D,
        INV_SQRT_D,
    )


def merge_fill_arguments(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    rotation: torch.Tensor,
    out: torch.Tensor,
    step: DecodeStep,
    window: RecentWindow,
    block_table: torch.Tensor,
) -> tuple:
    """The kernel's runtime arguments, in order: the merge's (:func:`merge_arguments`), then
    the step's (its tokens, positions and new lengths), the rings of ``window`` and
    ``block_table``."""
    batch, num_kv_heads = step.key.shape[:2]
    return (
        *merge_arguments(part_out, part_lse, rotation, out),
        token_arguments(step.key, step.value),
        ring_arguments(window),
        table_arguments(block_table),
        step.start_pos,
        step.start_pos.stride(0),
        step.new_lens,
        num_kv_heads,
        window.size,
        batch * num_kv_heads,
    )
