"""Log-sum-exp merge of the split (and ring) partials into the attention output.

Grid ``(ceil(B * Hq / BLOCK_M), D_PAD / BLOCK_D)``: rows, and for few rows of values that are not
rotated, column blocks of them. Rotated values go back to the original space here: a
Walsh-Hadamard butterfly for power-of-two head dims, products with R otherwise. A decode step's
merge, which also fills the ring, is :mod:`custom_ops.triton.decode.merge_fill`'s kernel around
the same :func:`merge_rows`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from custom_ops.triton.hadamard import walsh_hadamard_rows

__all__ = [
    "MergeConfig",
    "merge_config",
    "merge_rows",
    "merge_kernel",
    "merge_arguments",
    "launch_merge",
]

# Warps of a multi-row or many-partial program, and the most partial elements per lane of a
# one-warp program (148 registers at D = 128 and 32 splits, offline SASS; 64 splits spill).
NUM_WARPS = 4
LANE_FLOATS = 128


# Fewest columns of a program that merges a block of columns (a float32 row of 32 is 128 bytes:
# whole sectors).
MIN_BLOCK_D = 32


class MergeConfig(NamedTuple):
    """How the merge runs: ``block_m`` rows per program, partials read ``split_chunk`` at a
    time, ``num_warps`` per program, ``block_d`` columns per program (None: the whole padded
    head dim; a divisor of it only for values that are not rotated, whose rows need no
    butterfly over all their columns)."""

    block_m: int
    split_chunk: int
    num_warps: int
    block_d: int | None = None


def merge_config(
    num_rows: int, num_splits: int, head_dim: int, rotated_values: bool, sm_count: int | None
) -> MergeConfig:
    """As many rows per program as keep two programs per SM busy (up to 16, so a rotation is
    read once per 16 rows); where even one row per program leaves SMs idle and the values are
    not rotated, each row's columns in blocks (down to :data:`MIN_BLOCK_D`) until they do; and
    as many partials at a time as the rows' ``[block_m, chunk, block_d]`` float32 tile holds
    at ``LANE_FLOATS`` per thread (``sm_count`` None: not a GPU, 16 rows).

    Column blocks are for one sequence: its 32 query rows read 4 MB of partials at 1 x 32768
    (256 splits), and 32 programs, one per row, took 5.9 us of a 22.6 us decode (H200, Nsight
    Compute with warm caches): the reads of the few SMs in use wait on latency, not bandwidth.

    A program of one row whose partials fit one warp's registers (``LANE_FLOATS`` per lane)
    gets one warp and one chunk: with more warps, Triton lays them along the splits (the row's
    ``D`` fills a warp's lanes) and sums over them through shared memory
    (``docs/design/decode.md#two-warp-splits-and-the-one-warp-merge``).
    Rows of more partials keep four warps, and so does a rotation back by products with R
    (rotated values, head dim not a power of two), whose ``[D_PAD, 64]`` blocks of R would
    spill in one warp."""
    d_pad = triton.next_power_of_2(head_dim)
    rotate_by_product = rotated_values and head_dim != d_pad
    block_m = 16
    block_d = d_pad
    if sm_count is not None:
        while block_m > 1 and num_rows < 2 * sm_count * block_m:
            block_m //= 2
        if block_m == 1 and not rotated_values:
            while block_d > MIN_BLOCK_D and num_rows * (d_pad // block_d) < 2 * sm_count:
                block_d //= 2
    columns = None if block_d == d_pad else block_d
    fits_one_warp = num_splits * block_d <= 32 * LANE_FLOATS and not rotate_by_product
    if block_m == 1 and fits_one_warp:
        return MergeConfig(1, num_splits, 1, columns)
    # (256 partials of D = 128 at a time, one row, spilled 80 bytes at the 255-register cap;
    # 128 take 161 registers: offline SASS, docs/design/decode.md#lengths-and-integers-compiled-in)
    tile_floats = 32 * NUM_WARPS * LANE_FLOATS
    return MergeConfig(
        block_m, min(num_splits, max(1, tile_floats // (block_m * block_d))), NUM_WARPS, columns
    )


@triton.jit
def _merge_store(
    out,
    j,
    rows,
    row_ok,
    window_rows,
    window_ok,
    window_w,
    inv_total,
    part_out_ptr,
    out_ptr,
    WINDOW_PARTS: tl.constexpr,
    D: tl.constexpr,
):
    """Columns ``j`` of the merged rows: ``(out + sum_w window_w * window_partial) / total``,
    stored in the output's dtype."""
    col_ok = row_ok & (j < D)[None, :]
    if WINDOW_PARTS > 0:
        jj = j[None, None, :]
        window_out = tl.load(
            part_out_ptr + window_rows[:, :, None] * D + jj,
            mask=window_ok[:, :, None] & (jj < D),
            other=0.0,
        )
        out += tl.sum(window_out * window_w[:, :, None], axis=1)
    out_ptrs = out_ptr + rows[:, None] * D + j[None, :]
    tl.store(out_ptrs, (out * inv_total[:, None]).to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    num_rows,
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
):
    """:func:`merge_rows` of this program's rows and columns, once the kernels before it have
    finished."""
    if PDL:
        gdc_wait()  # for every partial
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


@triton.jit
def merge_rows(
    part_out_ptr,
    part_lse_ptr,
    rot_ptr,
    out_ptr,
    num_rows,
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
):
    """``out[row] = sum_s w_s * o_s / sum_s w_s`` with ``w_s = exp2(lse_s - max lse)`` for the
    ``BLOCK_M`` rows ``b * Hq + h`` of this program (grid axis 0) and its ``BLOCK_D`` columns
    (axis 1; every program of a row reads the row's lse), ``SPLIT_CHUNK`` splits at a time. Rotated
    values go back by a Walsh-Hadamard butterfly for power-of-two head dims (only R's first
    column is read), otherwise by ``[BLOCK_M, D] @ R^T`` products (R read once per ``BLOCK_M``
    rows); the window's ``WINDOW_PARTS`` partials (after the splits') are in the original space
    already."""
    NUM_PARTIALS: tl.constexpr = NUM_SPLITS + WINDOW_PARTS
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows[:, None] < num_rows
    split_lse = tl.load(
        part_lse_ptr + rows[:, None] * NUM_PARTIALS + tl.arange(0, NUM_SPLITS),
        mask=row_ok,
        other=float("-inf"),
    )
    m = tl.max(split_lse, axis=1)
    # [BLOCK_M, WINDOW_PARTS_PAD] partial rows and lse of the window
    window_part = tl.arange(0, WINDOW_PARTS_PAD)[None, :]
    window_rows = rows[:, None] * NUM_PARTIALS + NUM_SPLITS + window_part
    window_ok = row_ok & (window_part < WINDOW_PARTS)
    window_lse = tl.load(part_lse_ptr + window_rows, mask=window_ok, other=float("-inf"))
    m = tl.maximum(m, tl.max(window_lse, axis=1))
    m = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(
        tl.where(split_lse > float("-inf"), tl.math.exp2(split_lse - m[:, None]), 0.0), axis=1
    )
    tl.static_assert(BLOCK_D == D_PAD or not ROTATE_BACK, "rotated values: whole rows")
    columns = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d = columns[None, None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, SPLIT_CHUNK):
        part_rows = rows[:, None] * NUM_PARTIALS + s0 + tl.arange(0, SPLIT_CHUNK)[None, :]
        lse = tl.load(part_lse_ptr + part_rows, mask=row_ok, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - m[:, None]), 0.0)
        parts = tl.load(
            part_out_ptr + part_rows[:, :, None] * D + d,
            mask=row_ok[:, :, None] & (d < D),
            other=0.0,
        )
        acc += tl.sum(parts * w[:, :, None], axis=1)
    window_w = tl.where(window_lse > float("-inf"), tl.math.exp2(window_lse - m[:, None]), 0.0)
    total += tl.sum(window_w, axis=1)
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
    if ROTATE_BACK and D == D_PAD:
        # x = y @ R.T / sqrt(D) = (y @ H) * s / sqrt(D) for a power-of-two D (R = diag(s) @ H,
        # Walsh-Hadamard H, s = R[:, 0]): a butterfly in registers, exact in float32
        j = tl.arange(0, D)
        signs = tl.load(rot_ptr + j * D) * INV_SQRT_D
        out = walsh_hadamard_rows(acc, D, LOG2_D) * signs[None, :]
        _merge_store(
            out,
            j,
            rows,
            row_ok,
            window_rows,
            window_ok,
            window_w,
            inv_total,
            part_out_ptr,
            out_ptr,
            WINDOW_PARTS,
            D,
        )
    elif ROTATE_BACK:
        # padded head dims: x = y @ R.T / sqrt(D), 64 output columns at a time: rot_t[i, j] =
        # R[j, i]
        CHUNK: tl.constexpr = min(64, D_PAD)
        i = tl.arange(0, D_PAD)[:, None]
        for j0 in tl.static_range(0, D_PAD, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            rot_t = tl.load(
                rot_ptr + j[None, :] * D + i, mask=(i < D) & (j < D)[None, :], other=0.0
            )
            out = tl.dot(acc, rot_t, input_precision="ieee") * INV_SQRT_D
            _merge_store(
                out,
                j,
                rows,
                row_ok,
                window_rows,
                window_ok,
                window_w,
                inv_total,
                part_out_ptr,
                out_ptr,
                WINDOW_PARTS,
                D,
            )
    else:
        _merge_store(
            acc,
            columns,
            rows,
            row_ok,
            window_rows,
            window_ok,
            window_w,
            inv_total,
            part_out_ptr,
            out_ptr,
            WINDOW_PARTS,
            D,
        )


def merge_arguments(
    part_out: torch.Tensor, part_lse: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor
) -> tuple:
    """The merge kernel's runtime arguments, in order: the partials ``part_out [B, Hq,
    partials, D]`` / ``part_lse``, the rotation, ``out [B, Hq, D]`` and its row count."""
    return (part_out, part_lse, rotation, out, out.shape[0] * out.shape[1])


def launch_merge(
    launch,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    rotation: torch.Tensor,
    out: torch.Tensor,
    key: Hashable | None = None,
) -> None:
    """Merge ``part_out [B, Hq, partials, D]`` / ``part_lse`` into ``out [B, Hq, D]``
    (``launch``: the plan's launch of this kernel; ``key``: the launcher's specialization
    key)."""
    launch(*merge_arguments(part_out, part_lse, rotation, out), key=key)
