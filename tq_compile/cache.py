"""``TurboQuantKVCache``: a drop-in KV cache module with gpt-fast's ``update`` contract.

The module owns the paged cache as plain buffers and writes new tokens with
``torch.ops.tq.store_window`` (``tq.store`` without a window); ``update`` then returns
:class:`TurboQuantKVTensor` views of those buffers. In traced code the views are built *after*
the write (never writing through a view): in one compiled graph (torch 2.13, aot_eager and
inductor), an SDPA on a subclass input whose inner tensors a custom op has just mutated reads
them as they were before the write, silently; rebuilding the wrapper from the mutated buffers
reads the new data (``tests/tq_compile/test_cache.py``, the compiled update-then-attend test,
guards it). Eagerly the same two views are returned by every
update of a batch size, with that update's lengths: building them is host time per layer.

The cache of sequence ``b`` is pages ``b * pages_per_seq ... (b + 1) * pages_per_seq - 1``
(enough for the ``S_max - W`` positions that can leave a recent window of ``W``): a
static cache is the identity block table of the paged kernels.

Every buffer is passed to the ops as it is, never as a view of another dtype: a compiled step
then mutates the buffers in place (a view would make functionalization copy it back into its
buffer every step). ``model.to(dtype)`` / ``model.half()`` after ``setup_caches`` would convert
every floating-point one; the module's ``_apply`` converts only the rings (they hold the model's
tokens, so they follow a conversion between bfloat16 and float16, as a dense cache would) and
lets the others (meta records, rotation, keys' centres) follow device moves only.
"""

from __future__ import annotations

import operator
import warnings
from typing import NamedTuple

import torch
from torch import nn

from custom_ops import api, ops, validate
from custom_ops.formats import PagedKVCache, RecentWindow, get_format
from custom_ops.schema import StoreArgs, StoreWindowArgs, window_fields
from tq_compile.kv_tensor import TurboQuantKVTensor
from tq_compile.options import CacheOptions, check_count

__all__ = ["TurboQuantKVCache", "kv_cache_nbytes", "warn_unquantized_cache"]


class _Operands(NamedTuple):
    """The buffers a cache passes to the ops for its first ``B`` sequences."""

    planes: PagedKVCache
    window: RecentWindow | None  # the rings and centres of all max_batch_size sequences
    table: torch.Tensor  # [B, pages_per_seq] int32
    rotation: torch.Tensor


class TurboQuantKVCache(nn.Module):
    """Quantized KV cache for ``max_batch_size`` sequences of up to ``max_seq_length`` tokens.

    Its constructor starts with the ``cache_factory`` signature of ``examples/model.py``'s
    ``KVCache``, ``(max_batch_size, n_heads, max_seq_length, head_dim, dtype)``: gpt-fast's
    ``KVCache`` takes ``max_seq_length`` before ``n_heads``, so pass keywords there, or swap the
    caches of a set-up model with :func:`tq_compile.quantize_`. The format and its options
    follow as keywords.

    Args:
        max_batch_size: B, sequences held.
        n_heads: Hk, kv-heads.
        max_seq_length: S_max, tokens per sequence.
        head_dim: D.
        dtype: the model's dtype (bf16 / fp16): the logical dtype of the returned views.
        options: the format and its options (:class:`~tq_compile.options.CacheOptions`;
            default ``CacheOptions()``: 4bit_nc, window 128, 4 sinks).
        device: where to allocate (default: the current default device, so that gpt-fast's
            ``with torch.device(...)`` in ``setup_caches`` places it).
        warn_unquantized: warn (``UserWarning``) when the window and sinks cover
            ``max_seq_length``, so that no token is ever quantized (False: the caller warned,
            as ``TurboQuantCache`` does once for all its layers).
        **fields: :class:`~tq_compile.options.CacheOptions` fields as keywords
            (``preset="3bit_nc", window=64``), replacing those of ``options``.

    The recent window ``W`` and the sinks (sized down to what ``max_seq_length`` can use,
    :meth:`~tq_compile.options.CacheOptions.ring_for`) live in rings
    ``k_window``, ``v_window [B, Hk, W + sinks, D]`` of ``dtype``, the position of each slot in
    ``window_pos [B, Hk, W + sinks] int32``; a token is quantized when it leaves the window,
    the sinks' slots ``[W, W + sinks)`` keep the first positions for good. An update may start
    at any position up to the current length (rollback, speculative decoding, a new sequence
    from 0): the cache is then as if the final tokens had been written once, except that
    positions that had already left the ring stay quantized. With ``center_keys`` every key is
    stored minus ``key_center [B, Hk, D] float32``, the mean of the keys of positions
    ``[sinks, sinks + max(W, 1))``, set by the write that first sends a position to a page and
    reset by a write from position 0: attention is unchanged (softmax ignores a shift that all
    of a query's scores share) and the quantized keys lose less to the common component they
    no longer carry (``docs/design/cache.md``).

    ``options`` keeps the options as given; ``window`` and ``sinks`` are the counts in force
    (the default sinks resolved, the ring sized down to the capacity). Where they cover
    ``max_seq_length``, every token stays in ``dtype`` and the cache is as large as a dense one
    (a little larger: positions, a page, the rotation): it warns, naming both sizes.

    The buffers are the module's: moving it (``.to()``, ``.cuda()``, ``to_empty()``) replaces
    them; nothing may resize or restride them in place (eager updates read their metadata
    once, :func:`custom_ops.validate.fix_metadata`).
    """

    def __init__(
        self,
        max_batch_size: int,
        n_heads: int,
        max_seq_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        options: CacheOptions | None = None,
        device: torch.device | str | None = None,
        warn_unquantized: bool = True,
        **fields,
    ):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be the model's bfloat16 or float16, got {dtype}")
        for arg, value in (
            ("max_batch_size", max_batch_size),
            ("n_heads", n_heads),
            ("max_seq_length", max_seq_length),
        ):
            check_count(arg, value, 1)
        self.options = options = CacheOptions.of(options, fields)
        page_size, seed, center_keys = options.page_size, options.seed, options.center_keys
        self.kv_format = get_format(options.preset)
        self.seed = seed
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.page_size, self.model_dtype = page_size, dtype
        self.window, self.sinks = options.ring_for(max_seq_length)
        # Positions in the ring never need a page: the oldest S_max - W go to pages (the
        # sinks' pages are never written: a page's worth at most).
        pages_per_seq = max(1, -(-(max_seq_length - self.window) // page_size))
        self.pages_per_seq = pages_per_seq
        device = torch.get_default_device() if device is None else device  # honours `with device`
        cache = self.kv_format.allocate(
            max_batch_size * pages_per_seq, n_heads, page_size, head_dim, device
        )
        consts = api.make_constants(self.kv_format, head_dim, seed, device)
        table = torch.arange(max_batch_size * pages_per_seq, dtype=torch.int32, device=device)
        ring_shape = (max_batch_size, n_heads, self.window + self.sinks, head_dim)
        rings = [
            (name, torch.zeros(ring_shape, dtype=dtype, device=device))
            for name in ("k_window", "v_window")
            if self.has_rings
        ]
        if self.has_rings:  # no slot holds a position yet
            rings.append(
                ("window_pos", torch.full(ring_shape[:3], -1, dtype=torch.int32, device=device))
            )
        self.center_keys = center_keys
        if center_keys:  # no centre yet: keys are stored as they are until one is set
            centres = torch.zeros(
                max_batch_size, n_heads, head_dim, dtype=torch.float32, device=device
            )
            rings.append(("key_center", centres))
        for name, tensor in (
            *zip(cache._fields, cache, strict=True),
            ("block_table", table.reshape(max_batch_size, pages_per_seq)),
            *zip(consts._fields, consts, strict=True),
            *rings,
        ):
            self.register_buffer(name, tensor, persistent=False)
        # a decode token's append and attention can be one op (tq.decode_step; per batch
        # size where it pays: api.step_pays)
        self.fuses_steps = (
            self.has_rings
            and not center_keys
            and api.step_supported(self.kv_format, self.window, 1)
        )
        self.num_kv_heads, self.head_dim = n_heads, head_dim
        self.num_splits = self._choose_splits()
        self._forget_eager()
        if warn_unquantized and self.quantizes_nothing:
            warn_unquantized_cache(
                "TurboQuantKVCache",
                "max_seq_length",
                max_seq_length,
                options,
                max_batch_size,
                self.nbytes(),
                self.dense_nbytes(),
                "dense cache",
                stacklevel=2,
            )

    @property
    def quantizes_nothing(self) -> bool:
        """Whether the window and sinks cover ``max_seq_length``: every token stays in the
        ring, in the model's dtype."""
        return self.options.quantizes_nothing(self.max_seq_length)

    @property
    def has_rings(self) -> bool:
        """Whether the cache keeps a ring (a recent window, sinks or both)."""
        return self.window + self.sinks > 0

    def _forget_eager(self) -> None:
        """(Re)start eager updates' memos: their operands and views by batch size (see update),
        made from the buffers held now."""
        self._eager_operands: dict[int, _Operands] = {}
        self._eager_views: dict[int, tuple[TurboQuantKVTensor, TurboQuantKVTensor]] = {}
        self._eager_buffers = tuple(self._buffers.values())

    def _choose_splits(self) -> int:
        if self.options.num_splits is not None:
            return self.options.num_splits
        return api.default_num_splits(
            self.max_batch_size,
            self.k_codes.shape[1],
            self.pages_per_seq,
            self.page_size,
            self.window,
            self.k_codes.device,
        )

    def _apply(self, fn, recurse=True):
        # what fn does to a tensor of the model's dtype: a conversion to the other model dtype
        # (model.half(), .to(bfloat16)) converts the rings, which hold the model's tokens
        target = fn(torch.empty(0, dtype=self.model_dtype, device=self.rotation.device)).dtype
        converts = target != self.model_dtype and target in (torch.bfloat16, torch.float16)
        rings = [getattr(self, name) for name in ("k_window", "v_window") if self.has_rings]

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            # other buffers (codes, meta records, rotation, centres) keep their dtype and
            # values; a device move or to_empty() applies to all
            moved = fn(t)
            if moved.dtype == t.dtype or (converts and any(t is ring for ring in rings)):
                return moved
            return t.to(moved.device)

        was_meta = self.rotation.device.type == "meta"
        module = super()._apply(keep_dtype, recurse)
        if converts:
            self.model_dtype = target
        if was_meta and self.rotation.device.type != "meta":
            # materialized from the meta device (to_empty): the constants hold garbage now
            self._fill_constants()
        self.num_splits = self._choose_splits()  # the device may have changed
        self._forget_eager()  # of the buffers before the move
        return module

    @torch.no_grad()
    def _fill_constants(self) -> None:
        """(Re)write the rotation, the identity block table and the empty ring positions (after
        ``to_empty``)."""
        head_dim = self.rotation.shape[0]
        rotation = api.make_constants(self.kv_format, head_dim, self.seed).rotation
        self.rotation.copy_(rotation)
        pages = torch.arange(self.block_table.numel(), dtype=torch.int32)
        self.block_table.copy_(pages.reshape(self.block_table.shape))
        if self.has_rings:
            self.window_pos.fill_(-1)
        if self.center_keys:
            self.key_center.zero_()

    def _check_update(self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor):
        """Shapes always; position values where they can be read without a host sync (CPU, or
        ``TQ_CHECK_VALUES=1``): before anything is written."""
        where = "TurboQuantKVCache.update"
        if (
            not isinstance(input_pos, torch.Tensor)
            or input_pos.dim() != 1
            or (input_pos.dtype.is_floating_point or input_pos.dtype == torch.bool)
        ):
            got = (
                f"{input_pos.dtype} of shape {tuple(input_pos.shape)}"
                if isinstance(input_pos, torch.Tensor)
                else repr(input_pos)
            )
            raise TypeError(f"{where}: input_pos must be a 1-D integer tensor [T], got {got}")
        heads, head_dim = self.num_kv_heads, self.head_dim
        if k_val.dim() != 4 or v_val.shape != k_val.shape:
            raise ValueError(
                f"{where}: k_val and v_val must be [B, Hk, T, D] of one shape, got "
                f"{tuple(k_val.shape)} and {tuple(v_val.shape)}"
            )
        batch, num_kv_heads, n_new, dim = k_val.shape
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(
                f"{where}: batch {batch} (k_val.shape[0]) must be in [1, "
                f"{self.max_batch_size}] (the cache's max_batch_size)"
            )
        if (num_kv_heads, dim) != (heads, head_dim):
            raise ValueError(
                f"{where}: k_val has {num_kv_heads} kv-heads of dim {dim}; the "
                f"cache holds {heads} of dim {head_dim}"
            )
        if n_new < 1 or input_pos.shape[0] != n_new:
            raise ValueError(
                f"{where}: input_pos has {input_pos.shape[0]} positions for "
                f"{n_new} new tokens (k_val.shape[2]); expected T >= 1 of "
                "each"
            )
        if torch.compiler.is_compiling() or not validate.checks_values(input_pos):
            return  # traced: no values to read (the ops' own checks still run)
        low, high = int(input_pos.min()), int(input_pos.max())
        if low < 0 or high >= self.max_seq_length:
            bad = low if low < 0 else high
            raise ValueError(
                f"{where}: input_pos holds position {bad}; expected positions in "
                f"[0, {self.max_seq_length}) (max_seq_length)"
            )
        if (self.has_rings or n_new > 1) and not torch.equal(
            input_pos - low, torch.arange(n_new, device=input_pos.device, dtype=input_pos.dtype)
        ):
            why = (
                f"with a ring (window={self.window}, sinks={self.sinks})"
                if self.has_rings
                else "a prefill chunk (T > 1) is its sequence's last T positions, so"
            )
            raise ValueError(
                f"{where}: {why} new tokens take consecutive positions: input_pos "
                f"must be start .. start + T - 1, got "
                f"{input_pos.tolist()[:8]}"
            )

    def update(
        self, input_pos: torch.Tensor, k_val: torch.Tensor, v_val: torch.Tensor
    ) -> tuple[TurboQuantKVTensor, TurboQuantKVTensor]:
        """Quantize and store new tokens; return key and value views of the whole cache.

        Args:
            input_pos: ``[T] int64`` positions of the new tokens (the same for every sequence,
                as in gpt-fast); the cached length becomes ``input_pos.max() + 1``. Several
                tokens (and any token with a window or sinks) take ``start .. start + T - 1``,
                ``start`` at most the current length with a window or sinks (appending, or
                rewriting from ``start`` on).
            k_val, v_val: ``[B, Hk, T, D]`` new keys (after RoPE) and values, ``B <=
                max_batch_size``.

        Returns:
            ``(k, v)``: :class:`TurboQuantKVTensor` of logical shape ``[B, Hk, S_max, D]``.
            Views of several tokens carry ``k_val``/``v_val`` too: SDPA of those tokens over
            them attends over the chunk exactly (``tq.prefill``). Eagerly, every update of one
            token and one batch size returns the same two objects with that update's lengths:
            views kept from an earlier step show the cache as it is now (views derived from
            them, such as a ``repeat_interleave``, keep their lengths). In a traced step one
            token may be left pending in fresh views (``step_start``), stored by whatever
            consumes them: SDPA (``tq.decode_step``) or ``.dequantize()``; a compiled region
            must consume the views it gets (docs/design/cache.md#a-decode-tokens-store).
        """
        self._check_update(input_pos, k_val, v_val)
        batch, num_kv_heads, n_new, head_dim = k_val.shape
        # Eager steps pay host time per Python operation (each buffer read through
        # nn.Module.__getattr__ included): the operands and views of a batch size are looked up
        # once, and each line below is at most one kernel, none where a view does.
        eager = ops.is_eager()
        if eager and not all(map(operator.is_, self._eager_buffers, self._buffers.values())):
            self._forget_eager()  # a buffer was assigned since the memos were made
        operands = self._eager_operands.get(batch) if eager else None
        if operands is None:
            operands = self._operands(batch)
            if eager:
                self._eager_operands[batch] = operands
                # the module's own buffers: only replaced (_apply), never resized in place
                # (fix_metadata passes over the window's sinks and a None centre)
                validate.fix_metadata(
                    *operands.planes, *(operands.window or ()), operands.table, operands.rotation
                )
        planes, window, table, rotation = operands
        name = self.kv_format.name
        if (
            n_new == 1
            and not eager
            and self.fuses_steps
            and api.step_pays(batch, num_kv_heads)
            and _head_dim_contiguous(k_val, v_val)
        ):
            # Traced: a decode token is left pending in the (fresh) views, which show the cache
            # as it was and the token; whatever consumes them stores it (its arguments are
            # checked there, by the op that stores it): SDPA (tq.decode_step: the token attends
            # that and is appended, in the split kernel and the merge; or dense attention, then
            # the window store) or .dequantize() (docs/design/cache.md#a-decode-tokens-store).
            # Eager steps store it here: their views are reused across steps (below).
            start = input_pos[:1].expand(batch)
            return self._views(operands, start, k_val, v_val, step_start=start)
        # The codes are constants to autograd (the ops have no derivative); a chunk's views
        # still carry k_val / v_val as they are, through which attention's gradient flows.
        k_store, v_store = k_val.detach(), v_val.detach()
        if self.has_rings:
            # positions start .. start + T - 1: the store reads the start from input_pos (a
            # view, no kernel) and returns the new lengths start + T. A view of a graph input
            # may go into the traced launch: the store kernel has no inline PTX, so the launch's
            # mutation analysis sees what it writes (see custom_ops.triton.traced), and the view
            # counts as read only.
            start = input_pos[:1].expand(batch)
            seq_lens = ops.call(
                StoreWindowArgs(
                    k_store,
                    v_store,
                    *planes,
                    block_table=table,
                    start_pos=start,
                    rotation=rotation,
                    fmt=name,
                    **window_fields(window, StoreWindowArgs),
                )
            )
        else:
            pos = input_pos.to(torch.int64)
            pages = table[:, pos // self.page_size]  # [B, T]
            slots = pages * self.page_size + (pos % self.page_size).to(torch.int32)
            # [B, Hk, T, D] -> [B * T, Hk, D] rows in (sequence, token) order, like the slots
            keys = k_store.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
            values = v_store.transpose(1, 2).reshape(-1, num_kv_heads, head_dim)
            ops.call(
                StoreArgs(keys, values, *planes, slots.reshape(-1).to(torch.int32), rotation, name)
            )
            seq_lens = (pos.max() + 1).expand(batch).to(torch.int32)
        if n_new > 1 or (torch.is_grad_enabled() and (k_val.requires_grad or v_val.requires_grad)):
            # a prefill chunk (or a verify step): fresh views carrying its exact keys and values
            # (tq.prefill reads them), held only as long as the caller holds the views; with
            # autograd, a decode token's too (attention's gradient reaches it through them)
            return self._views(operands, seq_lens, k_val, v_val)
        if not eager or type(seq_lens) is not torch.Tensor:
            return self._views(operands, seq_lens)  # traced: fresh views of the mutated buffers
        # Eager decode: the views of this batch size are built once and get each update's
        # lengths (a wrapper subclass costs ~5 us of host to build). Like a dense cache's
        # buffers, the views returned by every update are the cache: they show its current
        # contents.
        views = self._eager_views.get(batch)
        if views is None:
            views = self._eager_views[batch] = self._views(operands, seq_lens)
        for view in views:
            view.seq_lens = seq_lens
        return views

    def _operands(self, batch: int) -> _Operands:
        """The buffers the ops take for the first ``batch`` sequences."""
        table = self.block_table if batch == self.max_batch_size else self.block_table[:batch]
        window = None
        if self.has_rings:  # whole: the ops take rings of at least B sequences
            key_center = self.key_center if self.center_keys else None
            window = RecentWindow(
                self.k_window, self.v_window, self.window_pos, self.sinks, key_center
            )
        planes = PagedKVCache(self.k_codes, self.v_codes, self.meta)
        return _Operands(planes, window, table, self.rotation)

    def _views(
        self,
        operands: _Operands,
        seq_lens: torch.Tensor,
        chunk_k: torch.Tensor | None = None,
        chunk_v: torch.Tensor | None = None,
        step_start: torch.Tensor | None = None,
    ):
        """Key and value views of ``operands``' sequences, of lengths ``seq_lens [B] int32``,
        carrying the update's exact keys and values ``chunk_k``/``chunk_v [B, Hk, T, D]`` (or
        None) and, for a token not stored yet, its positions ``step_start``
        (:class:`TurboQuantKVTensor`)."""
        return tuple(
            TurboQuantKVTensor.from_cache(
                side,
                self.kv_format.name,
                operands.planes,
                operands.table,
                seq_lens,
                operands.rotation,
                self.max_seq_length,
                self.num_splits,
                self.model_dtype,
                operands.window,
                chunk_k,
                chunk_v,
                step_start,
            )
            for side in ("key", "value")
        )

    def nbytes(self) -> int:
        """Bytes the cache holds, every buffer counted: codes and meta of every page slot, the
        rings (recent window and sinks, in the model's dtype) and their slots' int32 positions,
        the keys' centres, the block table and the rotation (``[D, D]`` float32, one per
        cache)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def dense_nbytes(self) -> int:
        """Bytes a dense cache of the model's dtype with the same capacity takes (K and V)."""
        num_kv_heads, head_dim = self.k_codes.shape[1], self.rotation.shape[0]
        elements = self.max_batch_size * num_kv_heads * self.max_seq_length * head_dim
        return 2 * elements * self.model_dtype.itemsize

    def extra_repr(self) -> str:
        return (
            f"preset={self.kv_format.name}, batch={self.max_batch_size}, "
            f"max_seq_length={self.max_seq_length}, page_size={self.page_size}, "
            f"window={self.window}, sinks={self.sinks}, center_keys={self.center_keys}, "
            f"num_splits={self.num_splits}"
        )


def _head_dim_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def kv_cache_nbytes(model: nn.Module) -> int:
    """Bytes held by every KV cache of ``model``: TurboQuant caches' planes, and the ``k_cache``
    / ``v_cache`` buffers of dense (gpt-fast style) ones."""
    total = 0
    for module in model.modules():
        if isinstance(module, TurboQuantKVCache):
            total += module.nbytes()
        else:
            buffers = dict(module.named_buffers(recurse=False))
            for name in ("k_cache", "v_cache"):
                if isinstance(buffers.get(name), torch.Tensor):
                    total += buffers[name].numel() * buffers[name].element_size()
    return total


def warn_unquantized_cache(
    where: str,
    capacity_name: str,
    capacity: int,
    options: CacheOptions,
    sequences: int,
    held: int,
    dense: int,
    dense_name: str,
    stacklevel: int,
) -> None:
    """Warn that a cache's window and sinks cover its capacity, so that it quantizes nothing
    (``UserWarning``; Python shows a message once per line that warns it).

    Args:
        where: the cache's class, for the message.
        capacity_name, capacity: the argument that sized the cache, and its value.
        options: the options it was given (window and sinks as asked).
        sequences: the sequences the byte counts are for.
        held, dense: bytes the cache holds, and bytes a dense cache of the model's dtype holds.
        dense_name: what the dense cache is called for this user (``StaticCache``, ...).
        stacklevel: the caller's ``stacklevel`` (1: the line calling this function's caller).
    """
    window, sinks = options.ring_for(capacity)
    warnings.warn(
        f"{where}: the recent window ({options.window}) and sinks ({options.sink_count}) cover "
        f"{capacity_name}={capacity}, so no token is ever quantized: every one stays in the "
        f"model's dtype, in a ring sized to the capacity (window {window}, sinks {sinks}). For "
        f"{sequences} sequence(s) the cache holds {held:,} bytes, {held / dense:.3f}x the "
        f"{dense:,} of a bf16 / fp16 {dense_name} of this capacity. To compress, keep window + "
        f"sinks below {capacity_name} (window={capacity // 4}, say); otherwise a {dense_name} "
        f"is smaller and faster.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
