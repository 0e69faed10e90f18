"""The TurboQuantKVCache that the tq_compile view and cache tests share: its shape and a cache
holding random tokens, with the key / value views its ``update`` returned; and dense attention
over such views, the oracle of SDPA through them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tq_compile import TurboQuantKVCache

B, HK, GROUP, S_MAX, D, WINDOW = 2, 2, 4, 48, 64, 16


def filled_tq_cache(
    fmt="4bit_nc", length=37, seed=0, dtype=torch.bfloat16, window=WINDOW, device="cpu"
):
    """A cache on ``device`` holding ``length`` random tokens (the last ``window`` in full
    precision), and its key / value views."""
    gen = torch.Generator().manual_seed(seed)
    cache = TurboQuantKVCache(
        B, HK, S_MAX, D, dtype, preset=fmt, page_size=16, window=window, device=device
    )
    k = (torch.randn(B, HK, length, D, generator=gen) * 2).to(dtype).to(device)
    v = torch.randn(B, HK, length, D, generator=gen).to(dtype).to(device)
    keys, values = cache.update(torch.arange(length, device=device), k, v)
    return cache, keys, values


def dense_attention(q, keys, values, attn_mask=None, is_causal=False, scale=None, softcap=0.0):
    """Float64 SDPA on the CPU of ``q [B, Hq, T, D]`` over the dequantized cache of the views
    ``keys`` / ``values`` (their heads repeated to q's), positions past each sequence's length
    masked out, ``attn_mask`` (bool, or additive) applied and ``is_causal`` top-left aligned,
    as dense SDPA over the same positions; with a ``softcap``, the scores capped at ``softcap *
    tanh(s / softcap)`` before the mask."""
    # a pending decode token as SDPA attends it: the cache as it was and the token, exact
    k = keys.dequantize(torch.float64, store_pending=False).cpu()
    v = values.dequantize(torch.float64, store_pending=False).cpu()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seq = k.shape[2]
    visible = (torch.arange(seq)[None, :] < keys.lengths().cpu()[:, None])[:, None, None, :]
    if is_causal:
        visible = visible & torch.ones(q.shape[2], seq, dtype=torch.bool).tril()
    if attn_mask is None:
        mask = visible
    elif attn_mask.dtype == torch.bool:
        mask = visible & attn_mask.cpu()
    else:
        mask = torch.where(visible, attn_mask.cpu().double(), -math.inf)
    if not softcap:
        return F.scaled_dot_product_attention(q.double().cpu(), k, v, attn_mask=mask, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.tanh(q.double().cpu() @ k.transpose(-1, -2) * scale / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    else:
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ v
