"""Dense attention that also returns its log-sum-exp: the exact half of ``tq.prefill``.

A prefill chunk attends over its own keys and values exactly, as the bf16 model does, and over
the compressed prefix by a kernel of ours; the two halves are merged by their log-sum-exp. Public
SDPA returns no log-sum-exp, so this module calls the private ATen kernels behind it, the only
place in the project that does: on CUDA the one SDPA itself would pick for these arguments
(``torch._fused_sdp_choice``: cuDNN on an H200, 1.8x faster than flash there at 32k tokens, so
the chunk costs what the bf16 model's attention costs), on the CPU the flash kernel for the CPU.
Every kernel here takes fewer key heads than query heads (GQA) as they are, except the
memory-efficient one, which gets them repeated.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from custom_ops import compat

__all__ = ["attention_lse"]

_aten = torch.ops.aten


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Hq, T, D]`` over ``k``, ``v [B, Hk, T, D]`` (``Hq`` a multiple of
    ``Hk``; causal with ``is_causal``, every key visible otherwise).

    Returns:
        ``(out, lse)``: ``out [B, Hq, T, D]`` in q's dtype (any strides) and ``lse [B, Hq, T]
        float32``, the natural log-sum-exp of each row's scaled scores.
    """
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale
        )
    choice = compat.fused_sdp_choice(q, k, v, is_causal, scale)
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        out, lse = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, is_causal, False, scale=scale
        )[:2]
        return out, lse.reshape(lse.shape[:3])  # [B, Hq, T, 1] -> [B, Hq, T]
    if choice == SDPBackend.FLASH_ATTENTION.value:
        out, lse = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale
        )[:2]
        return out, lse
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    if choice == SDPBackend.EFFICIENT_ATTENTION.value:
        out, lse = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal, scale=scale
        )[:2]
        return out, lse[:, :, : q.shape[2]]  # the kernel pads its rows to a multiple of 32
    # math (head dims no fused kernel takes): float32 scores, as SDPA's math backend computes
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), k.float()) * scale
    if is_causal:
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("bhts,bhsd->bhtd", (scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse
