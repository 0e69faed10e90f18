"""``TurboQuantCache``: a Hugging Face transformers ``Cache`` that keeps the KV cache quantized.

A drop-in for transformers' ``StaticCache``, compileable and CUDA-graph safe the same way::

    cache = TurboQuantCache.for_generation(model, ids, max_new_tokens=256, preset="4bit_nc")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=256)

(``for_generation`` sizes it for that request: ``max_cache_len`` = prompt + new tokens,
``max_batch_size`` = prompts x beams; ``TurboQuantCache(model.config, max_cache_len=...,
max_batch_size=...)`` builds one of any size.)

Each attention layer is a :class:`TurboQuantLayer` (transformers' ``CacheLayerMixin``
contract) owning one :class:`~tq_compile.cache.TurboQuantKVCache`: paged codes, the recent
window ring, all static buffers allocated at the first ``update`` and marked static for
``torch.compile``. ``update`` stores the new tokens (``torch.ops.tq.store`` /
``store_window``; in a compiled decode step the attention's ``tq.decode_step`` may store the
token instead, see ``TurboQuantKVCache.update``) and returns
:class:`~tq_compile.kv_tensor.TurboQuantKVTensor` views of shape ``[B, Hk, max_cache_len, D]``;
transformers' ``sdpa`` attention then reaches ``tq.decode`` through them (its ``repeat_kv``
and ``pack_gqa`` stay lazy), so no full-precision copy of the cache is ever made while
decoding (GQA groups up to 64 query heads per kv-head: ``kv_tensor.MAX_FOLDED_ROWS``). The
cached length is a device tensor, as in
``StaticLayer``, so a compiled decode step has static shapes and no host sync.

Layers of other kinds than attention over the whole past are refused at construction, except
sliding-window and chunked layers, which are served as full layers (every token is kept; the
model's mask still limits what each query sees) at the cost of their unused capacity.

Models whose attention is eager (``attn_implementation="eager"``, and Gemma 2, which runs
eagerly for its attention logit softcapping) are switched at construction to the attention
function this module registers with transformers, ``"turboquant"``
(:func:`turboquant_attention`): over this cache's views it is SDPA's route to the kernels, the
softcap included; over dense keys (layers kept in full precision, other caches) it is the
model's own eager attention, so the model computes what it computed before.
"""

from __future__ import annotations

import logging
import sys

import torch

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import (
        Cache,
        CacheLayerMixin,
        StaticLayer,
        get_layer_types_and_kwargs,
    )
    from transformers.configuration_utils import PreTrainedConfig, get_head_shapes
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tq_compile.hf needs Hugging Face transformers: pip install 'tq-compile[hf]'"
    ) from error

from custom_ops import compat
from tq_compile.cache import TurboQuantKVCache, warn_unquantized_cache
from tq_compile.kv_tensor import TurboQuantKVTensor, attention
from tq_compile.options import CacheOptions, check_count

__all__ = ["TurboQuantCache", "TurboQuantLayer", "turboquant_attention", "ATTENTION"]

_LOGGER = logging.getLogger(__name__)

# The attention implementation (transformers' AttentionInterface key) that eager models get.
ATTENTION = "turboquant"

# Layer kinds a full TurboQuant layer serves: the mask, built by the model from its config,
# restricts sliding and chunked layers; the cache keeps every token.
_SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def turboquant_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs
):
    """transformers' attention function ``"turboquant"`` (an ``AttentionInterface`` entry).

    Over a :class:`TurboQuantCache`'s views it is what the ``"sdpa"`` implementation does over
    them (the kernels, through :func:`tq_compile.kv_tensor.attention`) with the scores capped
    by ``softcap`` (Gemma 2's ``attn_logit_softcapping``) before the mask; a sliding window
    comes with the mask. Over dense keys it is the model's own eager attention (its module's
    ``eager_attention_forward``), given the additive mask it expects.

    Args:
        module: the attention module (its ``is_causal`` and ``num_key_value_groups``).
        query: ``[B, Hq, L, D]``.
        key, value: ``[B, Hk, S, D]``, views of a TurboQuant layer or dense tensors.
        attention_mask: the boolean ``[B, 1, L, S]`` mask of ``sdpa_mask``, or None.
        dropout, scaling, softcap: the module's (dropout must be 0 over the views).
        **kwargs: what the model passes on (``sliding_window``, ...).

    Returns:
        ``(out [B, L, Hq, D], None)``: no attention weights over the views.

    Raises:
        ValueError: dropout over the views; NotImplementedError: dense keys of a model without
            an eager attention function.
    """
    is_causal = kwargs.pop("is_causal", None)
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not isinstance(key, TurboQuantKVTensor):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(
                f"the '{ATTENTION}' attention over dense keys runs the model's eager attention, "
                f"and {type(module).__module__} has no eager_attention_forward"
            )
        mask = _additive_mask(attention_mask, query, key, is_causal)
        return eager(
            module,
            query,
            key,
            value,
            mask,
            dropout=dropout,
            scaling=scaling,
            softcap=softcap,
            **kwargs,
        )
    if dropout:
        raise ValueError(f"dropout must be 0 over a TurboQuantCache (inference), got {dropout}")
    # as the sdpa implementation decides: a mask left out means causal over a prompt
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = attention(
        query,
        key,
        value,
        attention_mask,
        is_causal,
        scaling,
        enable_gqa=True,
        softcap=softcap or 0.0,
    )
    return out.transpose(1, 2).contiguous(), None


def _additive_mask(mask, query, key, is_causal: bool):
    """The additive mask an eager attention function adds to its scores ``[B, H, L, S]`` for the
    boolean mask of ``sdpa_mask`` (or None, which it leaves out only where SDPA's top-left
    ``is_causal`` is exact, or where nothing is masked)."""
    queries, positions = query.shape[2], key.shape[2]
    if mask is None:
        if queries == 1 or not is_causal:
            return None
        mask = torch.ones(queries, positions, dtype=torch.bool, device=query.device).tril()
    if mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)


AttentionInterface.register(ATTENTION, turboquant_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)

# A layer's lazy_initialization never runs traced: in a compiled forward of a fresh cache (a
# compiled prefill, such as generate's chunked one) it runs eagerly at a graph break, so its
# buffers exist before the graph and are marked static (as StaticLayer's only are when not
# traced); under fullgraph=True the error gives this reason.
_EAGER_INITIALIZATION = torch.compiler.disable(
    reason="TurboQuantCache builds its layers eagerly; before a compiled prefill call "
    "cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)"
)


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's quantized cache, following transformers' ``StaticLayer``.

    Args:
        max_cache_len: S_max, tokens each sequence can hold (prompt + generated).
        options: the format and its options (:class:`~tq_compile.options.CacheOptions`),
            passed whole to the layer's :class:`~tq_compile.cache.TurboQuantKVCache`.
        max_batch_size: sequences to allocate for (default: the first ``update``'s batch);
            later calls may use a smaller batch.
    """

    is_compileable = True
    is_sliding = False
    cumulative_length: torch.Tensor

    def __init__(
        self,
        max_cache_len: int,
        options: CacheOptions | None = None,
        max_batch_size: int | None = None,
    ):
        super().__init__()
        check_count("max_cache_len", max_cache_len, 1)
        if max_batch_size is not None:
            check_count("max_batch_size", max_batch_size, 1)
        self.max_cache_len, self.max_batch_size = max_cache_len, max_batch_size
        self.options = CacheOptions.of(options, {})
        self.kv: TurboQuantKVCache | None = None
        # a tensor, as in StaticLayer: positions derived from it do not recompile each step
        self.cumulative_length = torch.tensor(0, dtype=torch.int64)

    @property
    def is_croppable(self) -> bool:
        """Rollback (``crop``, assisted generation) is exact: the ring records its slots'
        positions, so the tokens written after a crop replace the cropped ones (positions that
        had left the ring before stay quantized)."""
        return True

    def __repr__(self) -> str:
        options = self.options
        return (
            f"TurboQuantLayer({options.preset}, window={options.window}, "
            f"sinks={options.sink_count}, center_keys={options.center_keys})"
        )

    @_EAGER_INITIALIZATION
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the cache for the batch, heads, head dim, dtype and device of the first
        ``[B, Hk, T, D]`` states, and mark its buffers static for ``torch.compile``."""
        batch, num_kv_heads, _, head_dim = key_states.shape
        if value_states.shape[-1] != head_dim:
            raise ValueError(
                f"TurboQuantCache needs keys and values of one head dim, got {head_dim} and "
                f"{value_states.shape[-1]}"
            )
        capacity = batch if self.max_batch_size is None else self.max_batch_size
        if batch > capacity:
            raise ValueError(f"TurboQuantCache: batch {batch} exceeds max_batch_size={capacity}")
        self.dtype, self.device = key_states.dtype, key_states.device
        # the batch, as StaticLayer reports it (layers kept dense hold exactly this many)
        self.batch_size, self.num_heads = batch, num_kv_heads
        self.k_head_dim = self.v_head_dim = head_dim
        # TurboQuantCache warned at construction if the ring covers the capacity
        self.kv = TurboQuantKVCache(
            capacity,
            num_kv_heads,
            self.max_cache_len,
            head_dim,
            key_states.dtype,
            options=self.options,
            device=key_states.device,
            warn_unquantized=False,
        )
        self.cumulative_length = self.cumulative_length.to(self.device)
        # as StaticLayer: static addresses keep compiled graphs and CUDA graphs valid across
        # the in-place writes (never traced here: _EAGER_INITIALIZATION)
        for buffer in (*self.kv.buffers(), self.cumulative_length):
            compat.mark_static_address(buffer)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[TurboQuantKVTensor, TurboQuantKVTensor]:
        """Append ``[B, Hk, T, D]`` states after the cached ones; return key and value views
        ``[B, Hk, max_cache_len, D]`` of the whole cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_tokens = key_states.shape[-2]
        positions = torch.arange(new_tokens, device=self.device) + self.cumulative_length
        keys, values = self.kv.update(positions, key_states, value_states)
        self.cumulative_length.add_(new_tokens)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask: the views span the whole capacity."""
        return self.max_cache_len, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens cached (a 0-d device tensor once initialized, as in ``StaticLayer``)."""
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Empty the cache. Only the length is cleared: positions at or past it are never read,
        and the next sequence's tokens replace the old ones in the ring."""
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count; 0 does nothing); see ``is_croppable``."""
        _crop_length(self, tokens_to_remove)

    @torch.no_grad()
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences (beam search): sequence ``b`` becomes sequence
        ``beam_idx[b]``. The block table is the identity, so each sequence's pages move whole."""
        if not self.is_initialized:
            return
        beam_idx = beam_idx.to(self.device)
        batch = beam_idx.shape[0]
        sequences = [self.kv.k_codes, self.kv.v_codes, self.kv.meta]
        per_seq = [t.view(self.kv.max_batch_size, -1, *t.shape[1:]) for t in sequences]
        if self.kv.has_rings:
            per_seq += [self.kv.k_window, self.kv.v_window, self.kv.window_pos]
        if self.kv.center_keys:
            per_seq.append(self.kv.key_center)
        for tensor in per_seq:
            tensor[:batch] = tensor[:batch].index_select(0, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "TurboQuantCache has a fixed batch: allocate it with max_batch_size for the "
            "expanded batch and let generate() fill it (as for StaticCache)"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TurboQuantCache has a fixed batch: it cannot drop sequences")

    def offload(self):
        raise NotImplementedError("TurboQuantCache does not offload layers to the CPU")

    def prefetch(self):
        raise NotImplementedError("TurboQuantCache does not offload layers to the CPU")

    def nbytes(self) -> int:
        """Bytes held: every buffer of the layer's cache
        (:meth:`~tq_compile.cache.TurboQuantKVCache.nbytes`) and its length; 0 before the first
        ``update``."""
        if self.kv is None:
            return 0
        return self.kv.nbytes() + _tensor_bytes(self.cumulative_length)

    def dense_nbytes(self) -> int:
        """Bytes a ``StaticLayer`` of the same capacity and dtype holds (K, V and its length)."""
        if self.kv is None:
            return 0
        return self.kv.dense_nbytes() + _tensor_bytes(self.cumulative_length)


def _attention_implementation(config: PreTrainedConfig) -> str | None:
    """The attention implementation ``config`` selects (``"sdpa"``, ``"eager"``, ...).
    transformers keeps it in the private ``_attn_implementation`` (no public accessor in 5.x):
    the one place this module reads it (``TurboQuantCache`` sets the decoder's to
    :data:`ATTENTION` through the same attribute)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "_attn_implementation", None) or getattr(
        config, "_attn_implementation", None
    )


def _crop_length(layer: CacheLayerMixin, tokens_to_remove: int) -> None:
    """Forget a layer's last ``-tokens_to_remove`` tokens by its length alone: positions at or
    past the length are never read, and the next tokens overwrite them."""
    if not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
        raise ValueError(
            f"TurboQuantCache.crop takes a negative count of tokens to remove (or 0), as "
            f"transformers' caches do, got {tokens_to_remove!r}"
        )
    if tokens_to_remove == 0 or not layer.is_initialized:
        return
    layer.cumulative_length.add_(tokens_to_remove).clamp_(min=0)


class DenseLayer(StaticLayer):
    """A layer kept in full precision (``keep_first`` / ``keep_last``): transformers'
    ``StaticLayer``, croppable as the TurboQuant layers are (assisted generation rolls every
    layer back)."""

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative count; 0 does nothing)."""
        _crop_length(self, tokens_to_remove)

    @_EAGER_INITIALIZATION
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """``StaticLayer``'s, never traced (``_EAGER_INITIALIZATION``)."""
        super().lazy_initialization(key_states, value_states)


class TurboQuantCache(Cache):
    """A transformers ``Cache`` of :class:`TurboQuantLayer` (``StaticLayer`` for the layers
    kept in full precision), one per decoder layer of ``config``.

    Args:
        config: the model's config (``model.config``).
        max_cache_len: tokens each sequence can hold (prompt + generated).
        max_batch_size: sequences to allocate for (default: the first forward's batch).
        keep_first, keep_last: leading / trailing layers kept in full precision (vLLM keeps
            2 + 2 for its aggressive presets).
        options: the format and its options (:class:`~tq_compile.options.CacheOptions`;
            default ``CacheOptions()``: 4bit_nc, window 128, 4 sinks), passed whole to every
            quantized layer.
        **fields: :class:`~tq_compile.options.CacheOptions` fields as keywords
            (``preset="3bit_nc", window=64``), replacing those of ``options``.

    Where the window and sinks cover ``max_cache_len`` (``TurboQuantCache(config, 64)`` with the
    default window of 128), no token is ever quantized: the ring is sized down to the capacity
    (nothing is lost) and the cache warns once, here, with the bytes it will hold against a
    ``StaticCache``'s. :meth:`for_generation` sizes a cache for one ``generate`` call.

    Raises:
        ValueError: an unknown preset, a negative size, or a layer kind this cache cannot serve
            (linear attention, shared KV, ...).
        TypeError: a keyword that is no option.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int,
        *,
        max_batch_size: int | None = None,
        keep_first: int = 0,
        keep_last: int = 0,
        options: CacheOptions | None = None,
        **fields,
    ):
        options = CacheOptions.of(options, fields)  # every option checked, before anything
        check_count("max_cache_len", max_cache_len, 1)
        check_count("keep_first", keep_first, 0)
        check_count("keep_last", keep_last, 0)
        if max_batch_size is not None and (type(max_batch_size) is not int or max_batch_size < 1):
            raise ValueError(
                f"max_batch_size must be None or an integer >= 1, got {max_batch_size!r}"
            )
        text = config.get_text_config(decoder=True)
        if options.center_keys and getattr(text, "attn_logit_softcapping", None):
            raise ValueError(
                "center_keys=True cannot serve a model with attention logit softcapping "
                f"(attn_logit_softcapping={text.attn_logit_softcapping}): a cap changes with the "
                "centre that softmax alone ignores; use center_keys=False"
            )
        attention_implementation = _attention_implementation(config)
        # None: a config no model has set up yet (the model picks its default when it loads)
        if attention_implementation not in (None, "sdpa", ATTENTION):
            if attention_implementation != "eager":
                raise ValueError(
                    f"TurboQuantCache serves attn_implementation 'sdpa' or 'eager' (the latter "
                    f"through '{ATTENTION}'); this model's config says "
                    f"{attention_implementation!r}: load it with attn_implementation='sdpa' (or "
                    f"call model.set_attn_implementation('sdpa'))"
                )
            # the decoder reads its config's implementation at each forward; only its own: a
            # composite model's other towers (vision, audio) keep theirs
            text._attn_implementation = ATTENTION
            _LOGGER.info(
                "TurboQuantCache: the model's eager attention now runs as %r (the "
                "model's own eager attention over dense keys)",
                ATTENTION,
            )
        layer_types, _ = get_layer_types_and_kwargs(text)
        unserved = sorted(set(layer_types) - set(_SERVED_LAYER_TYPES))
        if unserved:
            raise ValueError(
                f"TurboQuantCache serves attention layers {_SERVED_LAYER_TYPES}; this model "
                f"also has {unserved} layers"
            )
        count = len(layer_types)
        kept = set(range(keep_first)) | set(range(count - keep_last, count))
        if len(kept) >= count:
            raise ValueError(
                f"TurboQuantCache would quantize no layer: keep_first={keep_first} and "
                f"keep_last={keep_last} keep all {count} layers in full precision (use "
                f"StaticCache for that, or keep fewer)"
            )
        self.options = options
        layers = [
            DenseLayer(max_cache_len)
            if index in kept
            else TurboQuantLayer(max_cache_len, options, max_batch_size)
            for index in range(count)
        ]
        super().__init__(layers=layers)
        if options.quantizes_nothing(max_cache_len):
            batch = max_batch_size or 1  # the first forward's batch: unknown yet
            held, dense = _planned_nbytes(config, self.layers, max_cache_len, batch)
            warn_unquantized_cache(
                "TurboQuantCache",
                "max_cache_len",
                max_cache_len,
                options,
                batch,
                held,
                dense,
                "StaticCache",
                stacklevel=2,
            )

    @classmethod
    def for_generation(
        cls,
        model,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        num_beams: int | None = None,
        num_return_sequences: int | None = None,
        keep_first: int = 0,
        keep_last: int = 0,
        options: CacheOptions | None = None,
        **fields,
    ) -> TurboQuantCache:
        """A cache sized for ``model.generate(input_ids, max_new_tokens=max_new_tokens, ...)``.

        ``max_cache_len`` is the prompt's length (padding included) plus ``max_new_tokens``,
        ``max_batch_size`` the prompts times ``max(num_beams, num_return_sequences)``, as
        ``generate`` sizes a ``StaticCache``; device and dtype are taken at the first forward.

        Args:
            model: a transformers model (its ``config`` is read).
            input_ids: ``[B, T]`` integer prompt tokens, the ones given to ``generate``.
            max_new_tokens: the ``max_new_tokens`` given to ``generate``.
            num_beams, num_return_sequences: as given to ``generate`` (None: the model's
                ``generation_config``, as ``generate`` reads them).
            keep_first, keep_last, options, **fields: as for :class:`TurboQuantCache`
                (``preset="3bit_nc", window=64``).

        Returns:
            A :class:`TurboQuantCache` for ``model.config``.

        Raises:
            TypeError: ``model`` without a transformers config, ``input_ids`` not an integer
                tensor, a keyword that is no option.
            ValueError: ``input_ids`` not ``[B, T]`` with ``B, T >= 1``, a count below 1, or
                what :class:`TurboQuantCache` refuses.
        """
        config = getattr(model, "config", None)
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"TurboQuantCache.for_generation: model must be a transformers model (a "
                f"PreTrainedConfig as .config), got {type(model).__name__}"
            )
        _check_prompt(input_ids)
        check_count("max_new_tokens", max_new_tokens, 1)
        beams = _generation_count(model, "num_beams", num_beams)
        returned = _generation_count(model, "num_return_sequences", num_return_sequences)
        expand = max(beams, returned)
        batch, prompt_length = input_ids.shape
        return cls(
            config,
            prompt_length + max_new_tokens,
            max_batch_size=batch * expand,
            keep_first=keep_first,
            keep_last=keep_last,
            options=options,
            **fields,
        )

    def nbytes(self) -> int:
        """Bytes held by every layer (TurboQuant layers' buffers: pages, the window and sinks in
        the model's dtype, positions, rotation; dense layers' K and V; the lengths)."""
        return sum(_layer_nbytes(layer, dense=False) for layer in self.layers)

    def dense_nbytes(self) -> int:
        """Bytes a ``StaticCache`` of the same capacity and dtype holds."""
        return sum(_layer_nbytes(layer, dense=True) for layer in self.layers)


def _tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _layer_nbytes(layer: CacheLayerMixin, dense: bool) -> int:
    """Bytes of one layer: a TurboQuant layer's own (or its dense equivalent's), a
    ``StaticLayer``'s K, V and length; 0 before the first forward."""
    if isinstance(layer, TurboQuantLayer):
        return layer.dense_nbytes() if dense else layer.nbytes()
    if not layer.is_initialized:
        return 0
    return _tensor_bytes(layer.keys, layer.values, layer.cumulative_length)


def _planned_nbytes(
    config: PreTrainedConfig, layers: list[CacheLayerMixin], max_cache_len: int, batch: int
) -> tuple[int, int]:
    """``(held, dense)``: bytes ``layers`` will hold for ``batch`` sequences of a bf16 / fp16
    model, and a ``StaticCache``'s, before the first forward allocates them. The kv-heads and
    head dims are the config's (per layer, as ``generate`` reads them); each TurboQuant layer's
    cache is built on the meta device, which allocates nothing, and its buffers counted."""
    num_heads, head_dims = get_head_shapes(config.get_text_config(decoder=True))
    count = len(layers)
    num_heads = num_heads if isinstance(num_heads, list) else [num_heads] * count
    head_dims = head_dims if isinstance(head_dims, list) else [head_dims] * count
    held = dense = 0
    for layer, heads, head_dim in zip(layers, num_heads, head_dims, strict=True):
        length = _tensor_bytes(layer.cumulative_length)
        static = 2 * batch * heads * max_cache_len * head_dim * 2 + length  # K, V of 2 bytes
        dense += static
        if not isinstance(layer, TurboQuantLayer):
            held += static
            continue
        kv = TurboQuantKVCache(
            batch,
            heads,
            max_cache_len,
            head_dim,
            torch.bfloat16,
            options=layer.options,
            device="meta",
            warn_unquantized=False,
        )
        held += kv.nbytes() + length
    return held, dense


def _check_prompt(input_ids) -> None:
    """Raise unless ``input_ids`` is a ``[B, T]`` integer tensor with ``B, T >= 1``."""
    where = "TurboQuantCache.for_generation"
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dtype.is_floating_point
        or (input_ids.dtype.is_complex or input_ids.dtype == torch.bool)
    ):
        got = (
            f"a {input_ids.dtype} tensor"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise TypeError(
            f"{where}: input_ids must be the [batch, prompt_length] integer tensor "
            f"given to generate (tokenizer(...)['input_ids']), got {got}"
        )
    if input_ids.dim() != 2 or min(input_ids.shape) < 1:
        raise ValueError(
            f"{where}: input_ids must be [batch, prompt_length] with both >= 1, got "
            f"shape {tuple(input_ids.shape)}"
        )


def _generation_count(model, name: str, value: int | None) -> int:
    """``value`` (an integer >= 1), or where None the model's ``generation_config``'s (1
    without one), as ``generate`` reads it."""
    if value is None:
        value = getattr(getattr(model, "generation_config", None), name, None) or 1
    check_count(name, value, 1)
    return value
