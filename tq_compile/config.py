"""``TurboQuantKVConfig``: the torchao ``quantize_`` config that swaps in TurboQuant caches.

``tq_compile.quantize_(model, TurboQuantKVConfig("4bit_nc"))`` replaces every KV-cache module of
a model (a module owning ``k_cache`` and ``v_cache`` buffers ``[B, Hk, S_max, D]``, like
gpt-fast's ``KVCache``) with a :class:`~tq_compile.cache.TurboQuantKVCache` of the same
capacity, device and dtype, except the first ``keep_first`` and last ``keep_last`` caches, which
stay in full precision (vLLM keeps 2 + 2 for its aggressive presets).

The handler is registered with torchao, so ``torchao.quantization.quantize_`` works too when
given ``filter_fn=is_kv_cache`` (torchao's own default filter selects ``nn.Linear`` layers; the
handler rejects those with a message saying so). ``keep_first`` / ``keep_last`` need the whole
model, so only ``tq_compile.quantize_`` applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization import quantize_ as torchao_quantize_
from torchao.quantization.transform_module import register_quantize_module_handler

from tq_compile.cache import TurboQuantKVCache
from tq_compile.options import CacheOptions, check_count

__all__ = ["TurboQuantKVConfig", "is_kv_cache", "quantize_"]


@dataclass(init=False)
class TurboQuantKVConfig(AOBaseConfig):
    """How to quantize a model's KV caches: the caches' options, and the caches kept dense.

    ``TurboQuantKVConfig("3bit_nc", window=64, keep_first=2)``: the format and its options as
    keywords, or ``options=CacheOptions(...)``, make one :class:`~tq_compile.options.CacheOptions`
    (checked at construction, before any model is touched) that every cache it builds gets
    whole.

    Args:
        preset: the format (``CacheOptions.preset``; default ``"4bit_nc"``).
        keep_first: number of leading KV caches left in full precision.
        keep_last: number of trailing KV caches left in full precision.
        options: the caches' options (default ``CacheOptions()``).
        **fields: :class:`~tq_compile.options.CacheOptions` fields as keywords, replacing
            those of ``options``.

    Raises:
        ValueError: an option out of range (naming it), ``keep_first`` / ``keep_last`` not a
            count.
        TypeError: a keyword that is no option.
    """

    options: CacheOptions
    keep_first: int
    keep_last: int

    def __init__(
        self,
        preset: str | None = None,
        *,
        keep_first: int = 0,
        keep_last: int = 0,
        options: CacheOptions | None = None,
        **fields,
    ) -> None:
        if preset is not None:
            fields["preset"] = preset
        self.options = CacheOptions.of(options, fields)
        check_count("keep_first", keep_first, 0)
        check_count("keep_last", keep_last, 0)
        self.keep_first, self.keep_last = keep_first, keep_last

    @property
    def preset(self) -> str:
        """The caches' format name."""
        return self.options.preset


def is_kv_cache(module: nn.Module, fqn: str = "") -> bool:
    """Whether ``module`` is a dense KV cache: it owns ``k_cache`` and ``v_cache`` buffers of
    shape ``[B, Hk, S_max, D]`` (``fqn`` is ignored; it is ``quantize_``'s filter signature)."""
    buffers = dict(module.named_buffers(recurse=False))
    k, v = buffers.get("k_cache"), buffers.get("v_cache")
    return (
        isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and k.dim() == 4
        and k.shape == v.shape
    )


@register_quantize_module_handler(TurboQuantKVConfig)
def _turboquant_kv_transform(module: nn.Module, config: TurboQuantKVConfig) -> nn.Module:
    if not is_kv_cache(module):
        raise TypeError(
            f"TurboQuantKVConfig applies to KV-cache modules (with k_cache / v_cache buffers "
            f"[B, Hk, S_max, D]), not {type(module).__name__}: torchao's quantize_ selects "
            "nn.Linear layers by default. Call tq_compile.quantize_(model, config), or pass "
            "filter_fn=tq_compile.is_kv_cache."
        )
    batch, num_kv_heads, max_seq_length, head_dim = module.k_cache.shape
    return TurboQuantKVCache(
        batch,
        num_kv_heads,
        max_seq_length,
        head_dim,
        module.k_cache.dtype,
        options=config.options,
        device=module.k_cache.device,
    )


def quantize_(
    model: nn.Module,
    config: TurboQuantKVConfig,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap ``model``'s KV caches for TurboQuant ones, in place (torchao's ``quantize_`` with a
    KV-cache default filter and ``keep_first`` / ``keep_last`` applied).

    Args:
        model: a model whose caches are set up (e.g. after gpt-fast's ``setup_caches``).
        config: the :class:`TurboQuantKVConfig`.
        filter_fn: ``(module, fqn) -> bool`` selecting caches (default: :func:`is_kv_cache`).

    Returns:
        ``model``.

    Raises:
        ValueError: no module matched (e.g. the caches are not set up yet), or every match is
            kept in full precision.
    """
    selected = filter_fn or is_kv_cache
    matches = [fqn for fqn, module in model.named_modules() if selected(module, fqn)]
    quantized = [
        fqn for fqn, module in model.named_modules() if isinstance(module, TurboQuantKVCache)
    ]
    if quantized:  # dense caches left by keep_first / keep_last would get another format
        raise ValueError(
            f"TurboQuantKVConfig({config.preset!r}): the model's KV caches are TurboQuant caches "
            f"already ({len(quantized)}, e.g. {quantized[0]!r}); quantize_ converts dense caches. "
            "To change the format, set the dense caches up again (gpt-fast: "
            "model.setup_caches(...)) and quantize those."
        )
    kept = set(matches[: config.keep_first])
    kept |= set(matches[len(matches) - config.keep_last :] if config.keep_last else [])
    targets = [fqn for fqn in matches if fqn not in kept]
    if not targets:
        raise ValueError(
            f"TurboQuantKVConfig({config.preset!r}) matched no KV cache to quantize: "
            f"{len(matches)} module(s) passed the filter and {len(kept)} are kept in full "
            "precision (keep_first / keep_last). Set the caches up first (gpt-fast: "
            "model.setup_caches(...)), or pass a filter_fn that selects them."
        )
    target_set = set(targets)
    torchao_quantize_(model, config, filter_fn=lambda module, fqn: fqn in target_set)
    return model
