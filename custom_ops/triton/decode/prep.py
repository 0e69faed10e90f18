"""Query preparation: rotate the queries into the keys' code space once per decode step.

Grid ``(ceil(B * Hq / BLOCK_Q), PARTS * PC_PAD / BLOCK_C)``, the blocks by :func:`prep_blocks`;
runs only for rotated keys with long splits (:class:`custom_ops.triton.decode.plan.QueryMode`),
where one rotation per query row is cheaper than one per split program.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

__all__ = ["prep_blocks", "prep_query_kernel", "launch_prep"]


def prep_blocks(num_rows: int) -> tuple[int, int]:
    """The preparation's blocks for a launch: larger ones where there are many rows.

    A program is one chain (the rows' load, the rotation's columns from L2, a small product, a
    store), so the kernel takes about that chain once per wave of programs. H200, the kernel
    alone at D 128, us with blocks of 16 x 16 everywhere against these: 32 rows 1.92 (the
    same), 512 rows 2.58 -> 2.30, 1,024 rows 3.35 -> 2.52, 2,048 rows 4.87 -> 2.85, 6,720 rows
    12.1 -> 5.61; the bounds sit between the measured sizes (16 x 16 was best at 32 rows, 32 x
    32 at 512 and 1,024, 32 x 64 at 2,048; docs/notes/2026-12-02-query-preparation.md).

    Args:
        num_rows: query rows, ``B * Hq`` (times the tokens per step).

    Returns:
        ``(BLOCK_Q, BLOCK_C)``: rows and columns per program (the prepared columns,
        ``PARTS * PC_PAD``, are a power of two of at least 64 for every head dim the formats
        take, so BLOCK_C divides them).
    """
    if num_rows <= 256:
        block_q, block_c = 16, 16
    elif num_rows <= 1024:
        block_q, block_c = 32, 32
    else:
        block_q, block_c = 32, 64
    return block_q, block_c


@triton.jit
def prep_query_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    rot_ptr,
    out_ptr,
    num_rows,
    num_q_heads,
    q_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    PARTS: tl.constexpr,
    PC: tl.constexpr,
    PC_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[r, c] = (q[r] @ R / sqrt(D))[p * PC + j] * q_scale`` as fp16, ``c = p * PC_PAD + j``,
    for the ``BLOCK_Q`` query rows ``r = b * Hq + h`` and ``BLOCK_C`` columns of this program: a
    ``[BLOCK_Q, D] @ [D, BLOCK_C]`` product on the tensor cores (tf32 is exact here: 16-bit
    queries times +-1), so R is read once per BLOCK_Q rows, by several programs at once."""
    if PDL:
        gdc_launch_dependents()  # the split kernel may launch now; it waits for q_code
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < num_rows
    q_rows = q_ptr + (rows // num_q_heads).to(tl.int64) * stride_qb
    q_rows += (rows % num_q_heads) * stride_qh
    d = tl.arange(0, D_PAD)
    q_mask = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    elem = (c // PC_PAD) * PC + c % PC_PAD
    ok = (c % PC_PAD) < PC
    rot = tl.load(
        rot_ptr + d[:, None] * D + elem[None, :], mask=(d[:, None] < D) & ok[None, :], other=0.0
    )
    q_code = tl.dot(q, rot, input_precision="tf32") * INV_SQRT_D
    q_code = tl.where(ok[None, :], q_code * q_scale, 0.0)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * (PARTS * PC_PAD) + c[None, :]
    tl.store(out_ptrs, q_code.to(tl.float16), mask=row_ok[:, None])


def launch_prep(
    launch,
    q: torch.Tensor,
    rotation: torch.Tensor,
    q_code: torch.Tensor,
    q_scale: float,
    key: Hashable | None = None,
) -> None:
    """Write ``q_code [B, Hq, PARTS * PC_PAD] fp16`` from ``q [B, Hq, D]`` (``launch``: the
    plan's :class:`~custom_ops.triton.launch.KernelLaunch` of this kernel; ``key``: the
    launcher's specialization key, see :class:`~custom_ops.triton.launch.Launcher`)."""
    batch, num_q_heads, _ = q.shape
    num_rows = batch * num_q_heads
    launch(q, q.stride(0), q.stride(1), rotation, q_code, num_rows, num_q_heads, q_scale, key=key)
