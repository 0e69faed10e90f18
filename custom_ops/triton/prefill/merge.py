"""Merge a chunk's attention and its prefix's attention by their log-sum-exp, in place.

When a prefill chunk's prefix is dequantized and attended by the dense kernel
(:func:`custom_ops.triton.prefill.prefill`'s dense prefix), each query row has two normalized
halves: ``o_c`` over the chunk with log-sum-exp ``l_c`` and ``o_p`` over the prefix with ``l_p``
(natural log, scaled scores). The row over both is ``(o_c e^l_c + o_p e^l_p) / (e^l_c + e^l_p)``.
Keys stored centred were attended without their centre, which softmax ignores within the prefix
but not beside the chunk: their log-sum-exp gets ``scale * q . centre`` back here.

One program merges ``BLOCK_T`` tokens of one (sequence, query head) into ``o_c``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from custom_ops.triton.launch import Launcher

__all__ = ["merge_prefix_kernel", "merge_prefix"]


@triton.jit
def merge_prefix_kernel(
    out_ptr,
    stride_ob,
    stride_oh,
    stride_ot,
    lse_ptr,
    stride_lb,
    stride_lh,
    stride_lt,
    prefix_ptr,
    stride_pb,
    stride_ph,
    stride_pt,
    prefix_lse_ptr,
    stride_xb,
    stride_xh,
    stride_xt,
    q_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    center_ptr,
    num_q_heads,
    num_kv_heads,
    tokens,
    scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    HAS_CENTER: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    batch_head = tl.program_id(0)
    b = (batch_head // num_q_heads).to(tl.int64)
    head = (batch_head % num_q_heads).to(tl.int64)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = t < tokens
    e = tl.arange(0, D_PAD)[None, :]
    ok = row_ok[:, None] & (e < D)
    lse_c = tl.load(
        lse_ptr + b * stride_lb + head * stride_lh + t * stride_lt, mask=row_ok, other=0.0
    )
    lse_p = tl.load(
        prefix_lse_ptr + b * stride_xb + head * stride_xh + t * stride_xt, mask=row_ok, other=0.0
    )
    if HAS_CENTER:
        group = num_q_heads // num_kv_heads
        centre = tl.load(
            center_ptr + (b * num_kv_heads + head // group) * D + e, mask=e < D, other=0.0
        )
        q = tl.load(
            q_ptr + b * stride_qb + head * stride_qh + t[:, None] * stride_qt + e,
            mask=ok,
            other=0.0,
        )
        lse_p += tl.sum(q.to(tl.float32) * centre, axis=1) * scale
    top = tl.maximum(lse_c, lse_p)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row that saw no key keeps zeros
    w_c = tl.exp(lse_c - top)
    w_p = tl.exp(lse_p - top)
    total = w_c + w_p
    total = tl.where(total > 0, total, 1.0)
    out_rows = out_ptr + b * stride_ob + head * stride_oh + t[:, None] * stride_ot + e
    o_c = tl.load(out_rows, mask=ok, other=0.0).to(tl.float32)
    o_p = tl.load(
        prefix_ptr + b * stride_pb + head * stride_ph + t[:, None] * stride_pt + e,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    merged = (o_c * (w_c / total)[:, None]) + (o_p * (w_p / total)[:, None])
    tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=16)
def _launcher(head_dim: int, has_center: bool, block_t: int) -> Launcher:
    return Launcher(
        merge_prefix_kernel,
        dict(
            D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            HAS_CENTER=has_center,
            BLOCK_T=block_t,
            num_warps=4,
        ),
    )


def merge_prefix(
    out: torch.Tensor,
    lse: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    q: torch.Tensor,
    scale: float,
    key_center: torch.Tensor | None = None,
    block_t: int = 32,
) -> None:
    """Merge the prefix's half into the chunk's, in place.

    Args:
        out: ``[B, Hq, T, D]`` the chunk's attention (any strides, last dim contiguous);
            overwritten with the attention over prefix and chunk.
        lse: ``[B, Hq, T] float32`` its natural log-sum-exp.
        prefix_out: ``[B, Hq, T, D]`` the attention over the prefix (last dim contiguous).
        prefix_lse: ``[B, Hq, T] float32`` its log-sum-exp, of keys without their centre.
        q: ``[B, Hq, T, D]`` the queries (read only with ``key_center``).
        scale: the softmax scale.
        key_center: optional ``[B, Hk, D] float32`` contiguous: the prefix's keys' centres.
    """
    batch, num_q_heads, tokens, head_dim = out.shape
    if out.numel() == 0:
        return
    num_kv_heads = num_q_heads if key_center is None else key_center.shape[1]
    grid = (batch * num_q_heads, triton.cdiv(tokens, block_t))
    _launcher(head_dim, key_center is not None, block_t)(
        grid,
        out,
        *out.stride()[:3],
        lse,
        *lse.stride(),
        prefix_out,
        *prefix_out.stride()[:3],
        prefix_lse,
        *prefix_lse.stride(),
        q,
        *q.stride()[:3],
        lse if key_center is None else key_center,
        num_q_heads,
        num_kv_heads,
        tokens,
        scale,
    )
