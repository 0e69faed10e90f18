"""The TurboQuantKVCache that the tq_compile view and cache tests share: its shape and a cache
holding random tokens, with the key / value views its ``update`` returned."""

from __future__ import annotations

import torch

from tq_compile import TurboQuantKVCache

B, HK, GROUP, S_MAX, D, WINDOW = 2, 2, 4, 48, 64, 16


def filled_tq_cache(fmt="4bit_nc", length=37, seed=0, dtype=torch.bfloat16, window=WINDOW,
                    device="cpu"):  # fmt: skip
    """A cache on ``device`` holding ``length`` random tokens (the last ``window`` in full
    precision), and its key / value views."""
    gen = torch.Generator().manual_seed(seed)
    cache = TurboQuantKVCache(B, HK, S_MAX, D, dtype, preset=fmt, page_size=16, window=window,
                              device=device)  # fmt: skip
    k = (torch.randn(B, HK, length, D, generator=gen) * 2).to(dtype).to(device)
    v = torch.randn(B, HK, length, D, generator=gen).to(dtype).to(device)
    keys, values = cache.update(torch.arange(length, device=device), k, v)
    return cache, keys, values
