"""``TurboQuantKVTensor``: a compressed KV cache that a model uses through plain SDPA.

A model written for a dense cache gets ``k, v = cache.update(input_pos, k, v)`` back and calls
``F.scaled_dot_product_attention(q, k, v, ...)``. With :class:`~tq_compile.cache.TurboQuantKVCache`
those ``k`` and ``v`` are ``TurboQuantKVTensor`` views of the paged, quantized cache: they have
the dense cache's logical shape ``[B, H, S_max, D]`` and the model's dtype, hold the packed
planes as inner tensors, and intercept SDPA in ``__torch_function__``:

* queries that all see the same positions (one decode token; or Hugging Face's ``pack_gqa``
  layout, a head group as query rows under one mask row): ``torch.ops.tq.decode`` over the
  compressed bytes, the attention mask passed through; in a traced step whose token the cache
  left pending in the views (``step_start``), ``torch.ops.tq.decode_step``, which also stores
  it;
* up to 16 query tokens with a mask per token (gpt-fast's causal-mask slice, Hugging Face's 4-D
  mask: a speculative-decoding verify step, a short chunk): ``torch.ops.tq.decode`` of the
  sequence's last ``T`` tokens, each seeing the cached positions its mask row allows (as
  dense SDPA: a causal mask orders them, a bidirectional prefix does not);
* otherwise (a prefill chunk: more tokens, ``is_causal``, a causal or per-query mask), when the
  view carries the chunk's own keys and values (``chunk_k``/``chunk_v``, the cache's last
  update): ``torch.ops.tq.prefill``, attention over the chunk's exact keys and values (as the
  bf16 model computes it) and over the compressed prefix before it, merged by log-sum-exp; the
  mask and ``is_causal`` applied exactly. A view without its chunk (one kept from an earlier
  update) dequantizes the cache (``torch.ops.tq.dequantize``) and runs SDPA on it, with
  positions past each sequence's length masked out. ``k[:, :, :n]`` (Hugging Face trims a
  static cache so before a causal prefill) keeps the first ``n`` positions.

With a recent window both read the ring run (the latest tokens, at most ``W``) from the
full-precision ring and the older ones from the compressed pages, in the same pass.

GQA call sites stay lazy: ``repeat_interleave(n, dim=1)``, and ``[:, :, None]`` /
``unsqueeze(2)`` + ``expand`` + ``reshape`` (Hugging Face's ``repeat_kv``), only record a head
group factor, so SDPA still reaches the grouped kernel and no full-precision copy is made.
Anything else raises (``NotImplementedError`` for other operators, ``TypeError`` /
``ValueError`` for unsupported views and arguments) with a message that names what is
supported, instead of silently dequantizing; ``dequantize()`` gives a dense tensor on purpose.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torchao.utils import TorchAOBaseTensor

from custom_ops import compat, ops
from custom_ops.formats import PagedKVCache, RecentWindow, sequence_capacity, window_size
from custom_ops.reference import overlay_chunk, softcap_scores
from custom_ops.schema import (
    DecodeArgs,
    DecodeStepArgs,
    DequantizeArgs,
    PrefillArgs,
    StoreWindowArgs,
    window_fields,
)
from custom_ops.validate import MAX_QUERY_TOKENS

__all__ = ["TurboQuantKVTensor", "attention"]

_SIDES = ("key", "value")
# the flattened fields (k_window, v_window, window_pos, sinks, key_center) of no window
_NO_WINDOW = (None, None, None, 0, None)


class TurboQuantKVTensor(TorchAOBaseTensor):
    """One side (keys or values) of a paged TurboQuant cache, as a tensor.

    Logical shape ``[B, Hk * group, S_max, D]`` (or ``[B, Hk, group, S_max, D]`` between the
    ``unsqueeze``/``expand`` and the ``reshape`` of a ``repeat_kv``) in the model's dtype.

    Tensor Attributes:
        k_codes, v_codes, meta: the cache planes (see ``custom_ops.formats``), shared by the key
            and the value view of one cache.
        block_table: ``[B, max_pages] int32`` page ids of each sequence.
        seq_lens: ``[B] int32`` number of cached tokens of each sequence.
        rotation: ``[D, D] float32`` +-1 rotation.
        k_window, v_window, window_pos, key_center: the recent window's tensors (``None``: no
            window; no centre), held one by one as the subclass protocol flattens them; read
            them together as :attr:`window`.
        chunk_k, chunk_v: optional ``[B, Hk, T, D]``: the keys and values of the update that
            made the view (its last ``T`` positions), as the model computed them: a prefill
            chunk attends over them exactly.
        step_start: a one-token update not stored yet (None: none pending; only in traced
            steps): its positions ``[B]``, ``input_pos``' dtype (then ``seq_lens`` holds the
            same: the lengths before it). SDPA of its token over the view runs
            ``tq.decode_step`` (attention over the cache as it was and the token, then the
            append); other SDPA calls attend densely, then store it (:meth:`stored`);
            :meth:`dequantize` stores it, then reads (docs/design/cache.md).

    Non-Tensor Attributes:
        fmt: format name (``custom_ops.FORMATS``).
        side: ``"key"`` or ``"value"``.
        max_seq_len: S_max, the logical sequence length.
        group: lazy head repetition: logical head ``h`` reads kv-head ``h // group``.
        split_heads: whether the view is 5-D ``[B, Hk, group, S_max, D]``.
        num_splits: the decode kernel's fixed split count for this cache.
        model_dtype: the logical dtype (bf16 / fp16).
        truncated: the view was sliced to its first ``max_seq_len`` positions (``k[:, :, :n]``,
            as Hugging Face's SDPA does before a causal prefill); attention over it always reads
            the dequantized prefix, since the decode kernel reads each sequence to its length.
        sinks: the rings' sink slots (attention sinks: each sequence's first positions).

    The constructor's arguments are the flattened form (``tensor_data_names``, then
    ``tensor_attribute_names``, then ``optional_tensor_data_names``) that ``TorchAOBaseTensor``
    rebuilds a tensor from; build a view with :meth:`from_cache`.
    """

    tensor_data_names = ["k_codes", "v_codes", "meta", "block_table", "seq_lens", "rotation"]
    tensor_attribute_names = [
        "fmt",
        "side",
        "max_seq_len",
        "group",
        "split_heads",
        "num_splits",
        "model_dtype",
        "truncated",
        "sinks",
    ]
    optional_tensor_data_names = [
        "k_window",
        "v_window",
        "window_pos",
        "key_center",
        "chunk_k",
        "chunk_v",
        "step_start",
    ]
    # the constructor's arguments, in order
    _FLAT_NAMES = (*tensor_data_names, *tensor_attribute_names, *optional_tensor_data_names)

    def __new__(
        cls,
        k_codes,
        v_codes,
        meta,
        block_table,
        seq_lens,
        rotation,
        fmt,
        side,
        max_seq_len,
        group,
        split_heads,
        num_splits,
        model_dtype,
        truncated,
        sinks,
        k_window=None,
        v_window=None,
        window_pos=None,
        key_center=None,
        chunk_k=None,
        chunk_v=None,
        step_start=None,
    ):
        batch, num_kv_heads, head_dim = block_table.shape[0], k_codes.shape[1], rotation.shape[0]
        if split_heads:
            shape = (batch, num_kv_heads, group, max_seq_len, head_dim)
        else:
            shape = (batch, num_kv_heads * group, max_seq_len, head_dim)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=model_dtype, device=k_codes.device, requires_grad=False
        )

    def __init__(self, *args, **kwargs):
        # the arguments of __new__, in its order (the flattened form), the trailing optional
        # tensors positionally or by keyword
        super().__init__()
        for name, value in zip(self._FLAT_NAMES, args, strict=False):
            setattr(self, name, value)
        for name in self._FLAT_NAMES[len(args) :]:
            setattr(self, name, kwargs.get(name))
        if self.side not in _SIDES:
            raise ValueError(f"side must be one of {_SIDES}, got {self.side!r}")

    # ---- construction helpers -------------------------------------------------------------

    @classmethod
    def from_cache(
        cls,
        side: str,
        fmt: str,
        cache: PagedKVCache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        rotation: torch.Tensor,
        max_seq_len: int,
        num_splits: int,
        model_dtype: torch.dtype,
        window: RecentWindow | None = None,
        chunk_k: torch.Tensor | None = None,
        chunk_v: torch.Tensor | None = None,
        step_start: torch.Tensor | None = None,
    ) -> TurboQuantKVTensor:
        """The ``side`` (``"key"`` or ``"value"``) view ``[B, Hk, max_seq_len, D]`` of a paged
        cache, before any GQA repetition.

        Args:
            side: ``"key"`` or ``"value"``.
            fmt: format name.
            cache: the planes (see ``custom_ops.formats``).
            block_table: ``[B, max_pages] int32``; seq_lens: ``[B] int32``.
            rotation: ``[D, D] float32``.
            max_seq_len: S_max, the logical length.
            num_splits: the decode split count of this cache.
            model_dtype: bf16 or fp16.
            window: the recent window (rings ``[B, Hk, W + sinks, D]``, their slots'
                positions, sinks and the keys' centre, ``tq.store_window``'s), or None.
            chunk_k, chunk_v: ``[B, Hk, T, D]`` the keys and values just written at each
                sequence's last ``T`` positions, as the model computed them, or None.
            step_start: with a one-token ``chunk_k``/``chunk_v`` not stored yet, its positions
                ``[B]`` (``seq_lens`` is then the same); else None.
        """
        k_window, v_window, window_pos, sinks, key_center = window or _NO_WINDOW
        return cls(
            *cache,
            block_table,
            seq_lens,
            rotation,
            fmt,
            side,
            max_seq_len,
            1,
            False,
            num_splits,
            model_dtype,
            False,
            sinks,
            k_window,
            v_window,
            window_pos,
            key_center,
            chunk_k,
            chunk_v,
            step_start,
        )

    def _with(self, **changes) -> TurboQuantKVTensor:
        """The same cache with some fields (attributes, or tensors such as the lengths) changed
        (no data is copied)."""
        fields = {name: getattr(self, name) for name in self._FLAT_NAMES}
        fields.update(changes)
        return TurboQuantKVTensor(*(fields[name] for name in self._FLAT_NAMES))

    def stored(self) -> TurboQuantKVTensor:
        """This view with its pending one-token update stored (``tq.store_window``; the view
        itself if none is pending): the same cache, at the lengths after the update, still
        carrying the token as given. Storing twice writes the same bytes (the token's slot then
        holds its own position: nothing leaves the ring)."""
        if self.step_start is None:
            return self
        seq_lens = ops.call(
            StoreWindowArgs(
                self.chunk_k.detach(),
                self.chunk_v.detach(),
                *self.planes,
                block_table=self.block_table,
                start_pos=self.step_start,
                rotation=self.rotation,
                fmt=self.fmt,
                **window_fields(self.window, StoreWindowArgs),
            )
        )
        return self._with(seq_lens=seq_lens, step_start=None)

    def lengths(self) -> torch.Tensor:
        """Each sequence's length as the view shows it, ``[B]``: ``seq_lens``, plus a pending
        token's position (``step_start + 1``: the cache as it was and the token)."""
        if self.step_start is None:
            return self.seq_lens
        return (self.step_start + 1).to(torch.int32)

    @property
    def planes(self) -> PagedKVCache:
        return PagedKVCache(self.k_codes, self.v_codes, self.meta)

    @property
    def window(self) -> RecentWindow | None:
        """The recent window (rings, their slots' positions, sinks and the keys' centre), or
        None; read off the flattened attributes, which is what compilation traces."""
        if self.k_window is None:
            return None
        return RecentWindow(
            self.k_window, self.v_window, self.window_pos, self.sinks, self.key_center
        )

    def dequantize(
        self, dtype: torch.dtype | None = None, uncenter: bool = True, store_pending: bool = True
    ) -> torch.Tensor:
        """Dense ``[B, H, S_max, D]`` (this view's logical shape) in ``dtype`` (default: the
        model's); positions past each sequence's length are zero. Keys stored centred get their
        centre back unless ``uncenter`` is False (then every key of a sequence-head is off by
        the same vector: attention over them is the same).

        A pending decode token (``step_start``) is stored first unless ``store_pending`` is
        False: the result is then the cache after the step, whose token leaving the recent
        window is read quantized (SDPA over the views attends that one exactly, one step
        longer: ``tq.decode_step``). Storing keeps the cache right whoever reads the views (a
        compiled step cannot tell later whether attention stored the token). With
        ``store_pending`` False nothing is written: the cache as it was and the pending token
        over its position, exactly what SDPA over the view attends (a test's oracle)."""
        if self.step_start is not None and store_pending:
            return self.stored().dequantize(dtype, uncenter)
        length = self.max_seq_len
        window = self.window
        if window is not None and not (uncenter and self.side == "key"):
            # (a value view's dequantize leaves the keys as stored: they are dropped)
            window = window._replace(key_center=None)
        if self.truncated:  # sequences may run past the prefix: dequantize all, keep the prefix
            length = sequence_capacity(
                self.block_table.shape[1], self.k_codes.shape[2], window_size(window)
            )
        lengths = self.lengths()
        k, v = ops.call(
            DequantizeArgs(
                *self.planes,
                self.block_table,
                lengths,
                self.rotation,
                self.fmt,
                length,
                dtype or self.model_dtype,
                **window_fields(window, DequantizeArgs),
            )
        )
        dense = (k if self.side == "key" else v)[:, :, : self.max_seq_len]
        if self.step_start is not None:  # the pending token, at each sequence's last position
            dense = overlay_chunk(
                dense, self.chunk_k if self.side == "key" else self.chunk_v, lengths
            )
        if self.split_heads:
            return dense[:, :, None].expand(self.shape)
        return dense.repeat_interleave(self.group, dim=1) if self.group > 1 else dense

    def __repr__(self) -> str:
        return (
            f"TurboQuantKVTensor(fmt={self.fmt}, side={self.side}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, group={self.group}, pages={self.k_codes.shape[0]}x"
            f"{self.k_codes.shape[2]}, device={self.device})"
        )

    def _stable_hash_for_caching(self) -> str:
        """Deterministic key for AOT autograd caching: the attributes and inner metadata."""
        names = self.tensor_data_names + self.optional_tensor_data_names
        inner = [
            (name, tuple(t.shape), str(t.dtype), tuple(t.stride()), str(t.device))
            for name in names
            for t in [getattr(self, name)]
            if t is not None
        ]
        attrs = [(name, str(getattr(self, name))) for name in self.tensor_attribute_names]
        payload = repr((type(self).__qualname__, tuple(self.shape), inner, attrs)).encode()
        return hashlib.blake2b(payload, digest_size=16).hexdigest()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        table = cls._ATEN_OP_TABLE.get(cls, {})
        if func in table:
            return table[func](func, types, args, kwargs or {})
        raise NotImplementedError(
            f"TurboQuantKVTensor (a compressed KV cache) does not support {func}: it supports "
            "F.scaled_dot_product_attention, repeat_interleave / unsqueeze / expand / reshape "
            "of the head dim (GQA), .to(device), detach, clone and .dequantize() (a dense copy)."
        )


implements_torch_function = TurboQuantKVTensor.implements_torch_function
aten = torch.ops.aten


# ---- lazy GQA views -----------------------------------------------------------------------


def _unsupported_view(name: str, t: TurboQuantKVTensor, detail: str) -> TypeError:
    return TypeError(
        f"TurboQuantKVTensor.{name}: only head repetition for GQA and a prefix of the "
        f"positions (k[:, :, :n]) are supported lazily "
        f"(got {detail} on shape {tuple(t.shape)}); call .dequantize() for a dense tensor"
    )


@implements_torch_function([torch.Tensor.repeat_interleave, torch.repeat_interleave])
def _repeat_interleave(func, types, args, kwargs):
    t, repeats = args[0], args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if t.split_heads or not isinstance(repeats, int) or dim not in (1, -3):
        raise _unsupported_view("repeat_interleave", t, f"repeats={repeats}, dim={dim}")
    return t._with(group=t.group * repeats)


@implements_torch_function([torch.Tensor.unsqueeze, torch.unsqueeze])
def _unsqueeze(func, types, args, kwargs):
    t, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if t.split_heads or t.group != 1 or dim not in (2, -3):
        raise _unsupported_view("unsqueeze", t, f"dim={dim}")
    return t._with(split_heads=True)


def _is_prefix(index) -> bool:
    """Whether ``index`` is ``slice(None or 0, n)`` with ``0 <= n``: the first positions."""
    return (
        isinstance(index, slice)
        and index.start in (None, 0)
        and index.step in (None, 1)
        and isinstance(index.stop, int)
        and 0 <= index.stop
    )


@implements_torch_function(torch.Tensor.__getitem__)
def _getitem(func, types, args, kwargs):
    t, index = args
    full = slice(None)
    if not isinstance(index, tuple) or index[:2] != (full, full):
        raise _unsupported_view("__getitem__", t, f"index {index!r}")
    rest_full = all(i == full or i is Ellipsis for i in index[3:])
    if len(index) >= 3 and index[2] is None and rest_full:
        return _unsqueeze(func, types, (t, 2), {})
    if len(index) >= 3 and not t.split_heads and _is_prefix(index[2]) and rest_full:
        # k[:, :, :n]: Hugging Face's SDPA trims a static cache to the prompt before a causal
        # prefill; the view keeps the first n positions
        return t._with(max_seq_len=min(index[2].stop, t.max_seq_len), truncated=True)
    raise _unsupported_view("__getitem__", t, f"index {index!r}")


@implements_torch_function(torch.Tensor.expand)
def _expand(func, types, args, kwargs):
    t = args[0]
    sizes = tuple(args[1]) if len(args) == 2 and not isinstance(args[1], int) else args[1:]
    sizes = tuple(int(s) for s in sizes)
    want = list(t.shape)
    if t.split_heads and t.group == 1 and len(sizes) == 5:
        want[2] = sizes[2]
        if tuple(s if s != -1 else w for s, w in zip(sizes, want, strict=True)) == tuple(want):
            return t._with(group=sizes[2])
    if sizes == tuple(t.shape):
        return t
    raise _unsupported_view("expand", t, f"sizes {sizes}")


@implements_torch_function([torch.Tensor.reshape, torch.Tensor.view, torch.reshape])
def _reshape(func, types, args, kwargs):
    t = args[0]
    shape = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
    shape = tuple(int(s) for s in shape)
    batch, heads, group, seq, dim = t.shape if t.split_heads else (0, 0, 0, 0, 0)
    if t.split_heads and shape in ((batch, heads * group, seq, dim), (batch, -1, seq, dim)):
        return t._with(split_heads=False)
    if shape == tuple(t.shape):
        return t
    raise _unsupported_view(func.__name__, t, f"shape {shape}")


# ---- attention ----------------------------------------------------------------------------


# Most query rows per kv-head (query heads per kv-head times query tokens) that queries sharing
# one mask row are folded into for one tq.decode: a decode step's GQA group, multi-query models'
# included (StarCoder's 48). The kernels hold a program's rows in registers; 64 rows are the
# most measured on a GPU (benchmarks/wide_gqa.py): wider groups (Falcon-7B's 71) read the
# dequantized cache until the 128-row launch is.
MAX_FOLDED_ROWS = 64

_SDPA_ARGS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _sdpa_arguments(args, kwargs) -> dict:
    bound = dict(zip(_SDPA_ARGS, _SDPA_DEFAULTS, strict=True))
    bound.update(zip(_SDPA_ARGS, args, strict=False))
    bound.update(kwargs)
    return bound


def _check_sdpa(q, k, v, dropout_p, enable_gqa, softcap) -> None:
    if not (isinstance(k, TurboQuantKVTensor) and isinstance(v, TurboQuantKVTensor)):
        raise TypeError(
            "scaled_dot_product_attention over a TurboQuantKVTensor needs both key "
            "and value from one TurboQuantKVCache"
        )
    if isinstance(q, TurboQuantKVTensor):
        raise TypeError("the query must be a dense tensor, not a TurboQuantKVTensor")
    if (k.side, v.side) != _SIDES or k.fmt != v.fmt or k.shape != v.shape:
        raise ValueError(
            f"key and value must be the key and value views of one cache, got {k!r} and {v!r}"
        )
    if k.split_heads:
        raise ValueError(f"the key view {tuple(k.shape)} is 5-D: reshape it to [B, H, S, D]")
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query must be [B, Hq, L, D] matching the cache's [B, H, S, D] = "
            f"{tuple(k.shape)}, got {tuple(q.shape)}"
        )
    if dropout_p:
        raise ValueError("dropout_p must be 0 with a TurboQuantKVTensor (inference only)")
    if type(softcap) not in (int, float) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be 0 (no cap) or a positive finite float, got {softcap!r}")
    if softcap and k.key_center is not None:
        # the kernels' scores leave out q . centre, which all of a query's scores share:
        # softmax ignores it, a cap does not
        raise ValueError(
            "softcap (Gemma 2's attention logit softcapping) needs keys stored as they are: "
            "build the cache with center_keys=False"
        )
    heads = k.shape[1]
    if q.shape[1] != heads and not (enable_gqa and q.shape[1] % heads == 0):
        raise ValueError(
            f"query has {q.shape[1]} heads and key {heads}: repeat the key/value "
            "heads or pass enable_gqa=True (as for dense SDPA)"
        )


def _mask_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    while attn_mask.dim() < 4:
        attn_mask = attn_mask[None]
    return attn_mask


def _decode_folded(
    q: torch.Tensor, k: TurboQuantKVTensor, attn_mask, scale: float, softcap: float
):
    """Attention of queries ``[B, Hq, L, D]`` that all see the same cached positions (Hugging
    Face's ``pack_gqa`` layout ``[B, Hk, group, D]``) through ``tq.decode``: the L queries of
    head ``h`` become query heads ``h * L .. h * L + L - 1``, which read the same kv-head as
    ``h``."""
    batch, q_heads, q_len, head_dim = q.shape
    mask = None
    if attn_mask is not None:
        mask = _mask_4d(attn_mask).select(2, 0)  # [B or 1, Hq or 1, S]
        if mask.shape[1] > 1:
            mask = mask.repeat_interleave(q_len, dim=1)
    out = _tq_decode(q.reshape(batch, q_heads * q_len, head_dim), k, mask, scale, softcap)
    return out.reshape(batch, q_heads, q_len, head_dim)


def _decode_tokens(
    q: torch.Tensor, k: TurboQuantKVTensor, attn_mask, scale: float, softcap: float
):
    """Attention of each sequence's last ``T`` tokens, queries ``[B, Hq, T, D]`` under a mask
    with a row per token (which alone decides what each token sees), through the multi-token
    ``tq.decode``. One decode token (T = 1, a mask or none) goes this way too: no view of q,
    the mask or the output to make (each is host time in an eager step)."""
    mask = None if attn_mask is None else _mask_4d(attn_mask)  # [B or 1, Hq or 1, T, S]
    return _tq_decode(q, k, mask, scale, softcap)


def _tq_decode(
    q: torch.Tensor, k: TurboQuantKVTensor, mask, scale: float, softcap: float
) -> torch.Tensor:
    """``tq.decode`` of ``q`` (``[B, Hq, D]`` or ``[B, Hq, T, D]``) over the cache of view
    ``k`` under ``mask`` (the op's form, or None), scores capped by ``softcap``."""
    return ops.call(
        DecodeArgs(
            q,
            *k.planes,
            k.block_table,
            k.seq_lens,
            k.rotation,
            k.fmt,
            k.num_splits,
            scale,
            mask,
            **window_fields(k.window, DecodeArgs),
            softcap=softcap,
        )
    )


def _decode_step(
    q: torch.Tensor,
    k: TurboQuantKVTensor,
    v: TurboQuantKVTensor,
    attn_mask,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """``tq.decode_step`` of queries ``q [B, H, L, D]`` at the pending token's position (its
    own, ``L = 1``; or HF's pack_gqa rows, ``[B, Hk, group, D]``, folded into the ``H * L``
    query heads of one step, row ``h * L + l`` reading kv-head ``h`` as ``h`` does) over the
    cache of view ``k`` as it was and the token (``k.chunk_k``, ``v.chunk_v``), then its
    append; the output ``[B, H, L, D]``."""
    batch, heads, rows, head_dim = q.shape
    mask = None
    if attn_mask is not None:  # [B|1, H|1, L|1, M] -> [B|1, H * L or 1, M]
        mask = _mask_4d(attn_mask)
        if mask.shape[2] == 1:
            mask = mask.select(2, 0)
            if mask.shape[1] > 1 and rows > 1:
                mask = mask.repeat_interleave(rows, dim=1)
        else:
            mask = mask.expand(mask.shape[0], heads, rows, mask.shape[3])
            mask = mask.reshape(mask.shape[0], heads * rows, mask.shape[3])
    out, _ = ops.call(  # (and the new lengths: the views are not reused)
        DecodeStepArgs(
            q.reshape(batch, heads * rows, head_dim),
            k.chunk_k,
            v.chunk_v,
            *k.planes,
            k.block_table,
            k.step_start,
            k.rotation,
            k.fmt,
            k.num_splits,
            scale,
            **window_fields(k.window, DecodeStepArgs),
            mask=mask,
            softcap=softcap,
        )
    )
    return out.reshape(batch, heads, rows, head_dim)


def _prefill(
    q: torch.Tensor,
    k: TurboQuantKVTensor,
    attn_mask,
    is_causal: bool,
    scale: float,
    softcap: float,
):
    """``tq.prefill``: the chunk that made the view (queries ``q [B, Hq, T, D]``, its last
    ``T`` positions) over its exact keys and values and the compressed prefix before it."""
    mask = None
    if attn_mask is not None:  # [B or 1, Hq or 1, T or 1, M] -> a row per token
        mask = _mask_4d(attn_mask)
        mask = mask.expand(mask.shape[0], mask.shape[1], q.shape[2], mask.shape[3])
    return ops.call(
        PrefillArgs(
            q,
            k.chunk_k,
            k.chunk_v,
            *k.planes,
            k.block_table,
            k.seq_lens,
            k.rotation,
            k.fmt,
            scale,
            is_causal,
            k.max_seq_len,
            mask,
            **window_fields(k.window, PrefillArgs),
            softcap=softcap,
        )
    )


@implements_torch_function(F.scaled_dot_product_attention)
def _scaled_dot_product_attention(func, types, args, kwargs):
    # every k.shape of a subclass would go through __torch_function__ again (an eager step
    # pays several microseconds each)
    with compat.DisableTorchFunctionSubclass():
        return _attention(_sdpa_arguments(args, kwargs), 0.0)


def attention(
    query: torch.Tensor,
    key: TurboQuantKVTensor,
    value: TurboQuantKVTensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the key and value views of a TurboQuant cache,
    with Gemma 2's attention logit softcapping, which SDPA lacks: each score ``s`` (``scale``
    times ``q . k``) becomes ``softcap * tanh(s / softcap)`` before the mask applies.

    Args:
        query: ``[B, Hq, L, D]``.
        key, value: the views a cache's ``update`` returned (``[B, Hk, S, D]``).
        attn_mask, is_causal, scale, enable_gqa: as for SDPA.
        softcap: the cap (0: none, which is SDPA over the views).

    Returns:
        ``[B, Hq, L, D]`` in the query's dtype.

    Raises:
        ValueError: a softcap that is negative or not finite, or one over keys stored
            centred; and what SDPA over the views refuses.
    """
    with compat.DisableTorchFunctionSubclass():
        bound = dict(
            query=query,
            key=key,
            value=value,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return _attention(bound, softcap)


def _attention(a: dict, softcap: float) -> torch.Tensor:
    """SDPA of the bound arguments ``a`` (:func:`_sdpa_arguments`) over a TurboQuant cache,
    scores capped by ``softcap`` (0: none)."""
    q, k, v, attn_mask = a["query"], a["key"], a["value"], a["attn_mask"]
    _check_sdpa(q, k, v, a["dropout_p"], a["enable_gqa"], softcap)
    head_dim = q.shape[-1]
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(head_dim)
    shared_row = attn_mask is None or _mask_4d(attn_mask).shape[2] == 1
    # the chunk that made the view, as its queries: attention over its exact keys and values
    carried = k.chunk_k is not None  # the update's tokens as given (a chunk, or with autograd)
    chunk = carried and k.chunk_k.shape[2] == q.shape[2]
    # the update's tokens are the queries' own: the chunk, or one decode token that HF's
    # pack_gqa layout shows as a head group's rows under one mask row
    own = chunk or (carried and k.chunk_k.shape[2] == 1 and shared_row)
    # a forward with autograd on: the ops have no derivative, dense attention has one
    differentiable = torch.is_grad_enabled() and (
        q.requires_grad or (own and (k.chunk_k.requires_grad or v.chunk_v.requires_grad))
    )
    if k.step_start is not None:
        # A one-token update not stored yet: the views show the cache as it was and the token.
        # Queries at its position (its own, or HF's pack_gqa rows of its head group) attend that
        # and append the token in one op; causal, truncated and differentiable calls attend it
        # densely, then store it.
        rows = q.shape[1] * q.shape[2] // k.k_codes.shape[1]
        if not a["is_causal"] and not k.truncated and not differentiable:
            if rows <= MAX_FOLDED_ROWS:
                return _decode_step(q, k, v, attn_mask, scale, softcap)
            if q.shape[2] == 1:  # a wider GQA group (MQA): the token stored, then tq.decode
                return _decode_tokens(q, k.stored(), attn_mask, scale, softcap)
        # dense attention over what the views show (the cache as it was and the token as given,
        # over its position: autograd reaches it through the views), then the token is stored
        out = _dense_over_views(q, k, v, a, scale, softcap, own=False)
        k.stored()
        return out
    if not a["is_causal"] and not k.truncated and not differentiable:
        # one token per sequence as it is; a few tokens with a mask row each (the mask alone
        # orders them: a causal one, a bidirectional prefix, HF's pack_gqa rows under a
        # per-head mask)
        if q.shape[2] == 1 or (not shared_row and q.shape[2] <= MAX_QUERY_TOKENS):
            return _decode_tokens(q, k, attn_mask, scale, softcap)
        # queries sharing one mask row that are not the chunk (HF's pack_gqa head group of a
        # decode step) folded into the query heads of one decode
        folded_rows = q.shape[1] * q.shape[2] // k.k_codes.shape[1]
        if shared_row and not chunk and folded_rows <= MAX_FOLDED_ROWS:
            return _decode_folded(q, k, attn_mask, scale, softcap)
    if chunk and not differentiable:
        return _prefill(q, k, attn_mask, a["is_causal"], scale, softcap)
    # Dense attention over the dequantized cache, with every position past a sequence's length
    # masked out: a view without its chunk (kept from an earlier update), or autograd (the
    # update's positions then hold its keys and values as the model computed them, as tq.prefill
    # reads them: the gradient reaches them and the query, the cached tokens are constants, as
    # a StaticCache's earlier tokens are to a step that did not compute them). Keys as stored
    # where softmax alone follows: it ignores the centre that all of a query's scores share.
    return _dense_over_views(q, k, v, a, scale, softcap, own)


def _dense_over_views(q, k, v, a: dict, scale: float, softcap: float, own: bool):
    """Dense SDPA of ``q`` over what the views ``k``/``v`` show (a pending token over its
    position, nothing stored: :meth:`TurboQuantKVTensor.dequantize`), every position past a
    sequence's length masked out, under ``a``'s mask and ``is_causal``; ``own``: the update's
    tokens (``chunk_k``/``chunk_v``) over their positions, as given."""
    keys = k.dequantize(q.dtype, uncenter=bool(softcap) or own, store_pending=False)
    values = v.dequantize(q.dtype, store_pending=False)
    if own:
        keys = overlay_chunk(keys, k.chunk_k, k.seq_lens)
        values = overlay_chunk(values, v.chunk_v, v.seq_lens)
    attn_mask = a["attn_mask"]
    seq = k.shape[2]
    visible = torch.arange(seq, device=q.device)[None, :] < k.lengths()[:, None]
    visible = visible[:, None, None, :]  # [B, 1, 1, S]
    if a["is_causal"]:  # top-left aligned, as dense SDPA does
        causal = torch.ones(q.shape[2], seq, dtype=torch.bool, device=q.device).tril()
        visible = visible & causal
    if attn_mask is None:
        mask = visible
    elif attn_mask.dtype == torch.bool:
        mask = visible & _mask_4d(attn_mask)
    else:
        mask = torch.where(visible, _mask_4d(attn_mask).to(q.dtype), float("-inf"))
    return _dense_attention(q, keys, values, mask, scale, a["enable_gqa"], softcap)


def _dense_attention(q, keys, values, mask, scale: float, enable_gqa: bool, softcap: float):
    """SDPA of ``q [B, Hq, L, D]`` over dense ``keys``/``values [B, H, S, D]`` under ``mask``
    (bool, or additive); with a ``softcap``, the same in float32 with the scores capped before
    the mask (SDPA has no cap), a row with no visible position giving zeros."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = softcap_scores(q.float() @ keys.transpose(-1, -2) * scale, softcap)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    no_key = (scores == float("-inf")).all(dim=-1, keepdim=True)
    # such a row's softmax would be NaN, and so its gradient through the mask: zeros instead
    probs = torch.softmax(scores.masked_fill(no_key, 0.0), dim=-1).masked_fill(no_key, 0.0)
    return (probs @ values).to(q.dtype)


# ---- .to(): device moves and the logical (model) dtype ---------------------------------------


@TurboQuantKVTensor.implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    t = args[0]
    to = t._get_to_kwargs(*args[1:], **kwargs)
    if to["dtype"] not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"TurboQuantKVTensor's dtype is the model's (bf16 or fp16), got "
            f"{to['dtype']}; call .dequantize(dtype) for a dense copy"
        )
    tensors = [
        getattr(t, n).to(to["device"], non_blocking=to["non_blocking"])
        for n in t.tensor_data_names
    ]
    attrs = [
        getattr(t, n) if n != "model_dtype" else to["dtype"] for n in t.tensor_attribute_names
    ]
    optional = [
        r if r is None else r.to(to["device"], non_blocking=to["non_blocking"])
        for r in (getattr(t, n) for n in t.optional_tensor_data_names)
    ]
    return TurboQuantKVTensor(*tensors, *attrs, *optional)
