"""The ``torch.ops.tq`` operators: schemas, fake (meta) implementations and device dispatch.

Each operator's schema is derived from its argument ``NamedTuple`` in :mod:`custom_ops.schema`
(the one place its arguments are listed); the real and the fake implementation both receive
that tuple and validate it first (:mod:`custom_ops.validate`), so bad input raises before any
kernel runs, eagerly and while tracing. CUDA tensors run the Triton kernels; CPU tensors run the
pure-torch reference, or the same Triton kernels under ``TRITON_INTERPRET=1`` inside
:func:`triton_on_cpu` (how the tests exercise the kernels without a GPU).

The operators are defined with ``torch.library.Library`` rather than ``custom_op``: the same
dispatch, functionalization and ``opcheck`` support, for a fraction of the per-call host cost.
The layers above run them through :func:`call`, which in eager mode on CUDA skips even that
dispatch (the operator's implementation, called directly) unless something would see the op.
In graphs that inductor compiles without CUDA graphs, ``store``, ``store_window`` and ``decode``
on CUDA are traced *through*: their launches become nodes of the graph and inductor's code
launches the kernels itself, with no op call per step (:func:`inductor_launches`,
:mod:`custom_ops.triton.traced`; importing this module has inductor launch them through its
static CUDA launcher, :func:`custom_ops.triton.traced.static_launch_by_default`). Under CUDA
graphs, other backends, ``torch.export``, dynamic shapes, on the CPU and in eager mode they
stay opaque calls.

* ``tq.store(key, value, k_codes!, v_codes!, meta!, slot_mapping, rotation, fmt)``: quantize
  ``key``/``value [N, Hk, D]`` (bf16/fp16, any strides) into the cache planes (see
  :mod:`custom_ops.formats`) at ``slot_mapping [N] int32`` (``page * page_size + offset``;
  negative slots are padding and skipped; two tokens of one call with the same slot leave one
  of them there, which one unspecified on CUDA, the last on the CPU). Returns nothing.
* ``tq.store_window(key, value, k_codes!, v_codes!, meta!, k_window!, v_window!, window_pos!,
  block_table, start_pos, rotation, fmt, sinks=0, key_center!=None) -> seq_lens``: write
  ``key``/``value [B, Hk, T, D]`` at positions ``start_pos[b] ..`` (``[B]`` int32 or int64,
  any stride, so a model's ``input_pos[:1].expand(B)`` as it is; at most the current length:
  appends, rollbacks and restarts alike; negative skips the sequence) to sequences whose latest
  positions (a run of at most ``W``) and first ``sinks`` positions (attention sinks, never
  quantized) live in the rings ``k_window``/``v_window [>= B, Hk, W + sinks, D]`` (contiguous
  bf16/fp16, position ``p`` at slot ``p % W``, a sink at slot ``W + p``;
  :func:`custom_ops.formats.ring_window`), ``window_pos [>= B, Hk, W + sinks] int32``
  recording each slot's position (-1: none; a new cache fills it with -1). A token that leaves
  the ring while still part of its sequence is quantized into its page exactly once
  (:func:`custom_ops.reference.store_window`); pages are needed only below ``len - W``, so a
  sequence of ``block_table [>= B, max_pages]`` holds ``max_pages * page_size + W`` positions.
  Returns the new lengths ``[B] int32`` (``start_pos + T``; 0 for a skipped sequence), what
  ``tq.decode`` takes next (on CUDA the store kernel writes them: no launch of their own).
  With ``key_center [B, Hk, D] float32`` (the rings' batch; zeros in a new cache) every key is
  stored minus its sequence-head's centre, which the op sets at the write that first sends
  positions to pages (the mean of positions ``[sinks, sinks + max(W, 1))``) and resets at a
  write from position 0 (:func:`custom_ops.reference.center_keys`): ``tq.decode`` reads the
  stored keys as they are, since softmax ignores a shift that all of a query's scores share.
* ``tq.dequantize(k_codes, v_codes, meta, block_table, seq_lens, rotation, fmt, max_seq_len,
  dtype, k_window=None, v_window=None, window_pos=None, sinks=0, key_center=None) -> (K, V)``:
  dense ``[B, Hk, max_seq_len, D]`` of ``dtype`` (bf16, fp16, fp32 or fp64) for ``block_table
  [B, max_pages] int32`` and ``seq_lens [B] int32``; zeros at and past each length; with the
  rings, each sequence-head's ring run (:func:`custom_ops.reference.ring_start` .. len) and
  sinks are copied from them; with ``key_center`` the keys get their centres back.
  ``max_seq_len`` is at most the sequence capacity.
* ``tq.decode(q, k_codes, v_codes, meta, block_table, seq_lens, rotation, fmt, num_splits,
  scale, mask=None, k_window=None, v_window=None, window_pos=None, sinks=0, softcap=0.0) ->
  out``: attention of ``q [B, Hq, D]`` (bf16/fp16, ``Hq`` a multiple of ``Hk``) over each
  sequence's cache, ``[B, Hq, D]`` in q's dtype; or of ``q [B, Hq, T, D]``, ``T <= 16``, the
  sequence's last ``T`` tokens (a speculative-decoding verify step), ``[B, Hq, T, D]``: without
  a mask token ``t`` sees the positions below ``len - T + t + 1``; a mask (for all tokens, or
  ``[B or 1, Hq or 1, T, M]``, per token) alone decides which positions below ``len`` each
  token sees, as dense SDPA does (gpt-fast's and Hugging Face's masks are causal; a
  bidirectional prefix stays one). Block-table entries past a sequence's pages may hold
  anything (short contexts read them early but never follow them); a sequence of length 0
  gives zeros. ``num_splits`` is the fixed split count (a power of two,
  :mod:`custom_ops.splits`; launches of many query rows per program may use fewer), ``scale``
  the softmax scale, ``mask`` an optional ``[B or 1, Hq or 1, M]`` bool (False masks out) or
  additive float mask over cache positions (positions ``>= M`` masked out; a query with no
  visible key gets zeros). With the rings, each sequence-head's ring run and sinks are read
  from them in full precision. ``softcap > 0`` caps each score ``s`` at ``softcap * tanh(s /
  softcap)`` before the mask.
* ``tq.decode_step(q, key, value, k_codes, v_codes, meta, block_table, start_pos, rotation,
  fmt, num_splits, scale, k_window, v_window, window_pos, sinks=0, mask=None, softcap=0.0) ->
  (out, new_lens)``: a one-token decode step and its append in one op. ``q [B,
  Hq, D]`` attends each sequence's cache as it is (the positions below ``start_pos[b]``: pages,
  ring run and sinks, as ``tq.decode`` reads them) and the step's own ``key``/``value [B, Hk,
  1, D]`` (contiguous head dim) at ``start_pos[b]``, exactly, as a one-token ``tq.prefill``
  chunk attends itself; then the token is appended as ``tq.store_window`` appends it (the
  token leaving the ring is quantized after the step attended it in full precision). Needs a
  recent window (``W > 0``) and values in the original space. Returns the output (q's shape
  and dtype) and the new lengths ``[B] int32`` (``start_pos + 1``; 0 and zeros for a skipped
  sequence). On CUDA two launches, the split kernel (which also moves the token leaving the
  ring into its page) and the merge (which also writes the step's token into the ring;
  :mod:`custom_ops.triton.decode`).
* ``tq.prefill(q, key, value, k_codes, v_codes, meta, block_table, seq_lens, rotation, fmt,
  scale, is_causal, max_seq_len, mask=None, k_window=None, v_window=None, window_pos=None,
  sinks=0, key_center=None, softcap=0.0) -> out``: attention of a chunk of ``T`` tokens just
  stored, queries ``q [B, Hq, T, D]``, over their own keys and values ``key``/``value [B, Hk,
  T, D]`` as the model computed them (exact, not their codes) and over each sequence's cached
  prefix, the positions below ``start = seq_lens[b] - T`` (``seq_lens >= T``): compressed
  pages, ring and sinks, keys with their centre. Position ``p`` is visible to token ``t`` below
  ``min(len, max_seq_len)`` where the optional ``mask [B or 1, Hq or 1, T, M]`` (bool, or
  additive; positions ``>= M`` masked) allows it and, with ``is_causal``, where ``p <= t``
  (SDPA's top-left order: a causal chunk when ``start`` is 0).
  ``[B, Hq, T, D]`` in q's dtype and layout (``torch.empty_like(q)``'s strides: a model's
  ``transpose(1, 2)`` of a transposed q is then contiguous); a row with no visible key gets
  zeros (:func:`custom_ops.reference.prefill`); scores capped by ``softcap`` as for decode (on
  every device by the reference's arithmetic: neither the dense kernel nor the prefix kernel
  caps).

``rotation`` (``[D, D] float32``, entries +-1) must be :func:`custom_ops.codebook.rotation_matrix`
(for a power-of-two D the CUDA store and decode kernels use its Walsh-Hadamard structure, ``R =
diag(s) @ H``). The Lloyd-Max levels are not an argument: they follow from the format and the
head dim (:func:`custom_ops.codebook.signed_levels`), the same on every path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from triton import knobs

from custom_ops import compat, reference, sdpa_lse, validate
from custom_ops.formats import PagedKVCache
from custom_ops.schema import (
    DecodeArgs,
    DecodeStepArgs,
    DequantizeArgs,
    PrefillArgs,
    StoreArgs,
    StoreWindowArgs,
    op_schema,
    window_of,
)
from custom_ops.thread_flag import ThreadFlag
from custom_ops.triton import dequant as triton_dequant
from custom_ops.triton import prefill as triton_prefill
from custom_ops.triton import store as triton_store
from custom_ops.triton import store_window as triton_store_window
from custom_ops.triton import traced
from custom_ops.triton.decode import decode as triton_decode
from custom_ops.triton.decode import decode_step as triton_decode_step

__all__ = ["triton_on_cpu", "inductor_launches", "call", "is_eager"]

_TRITON_ON_CPU = ThreadFlag()
_lib = torch.library.Library("tq", "DEF")
# operator name and implementation ``impl(args, launch_key)`` by argument tuple type
_IMPLS: dict[type, tuple[str, Callable]] = {}


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Run the ops' Triton kernels on CPU tensors (needs ``TRITON_INTERPRET=1`` at import)."""
    if not knobs.runtime.interpret:
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1 set before triton kernels "
            "are defined (before importing custom_ops)"
        )
    with _TRITON_ON_CPU.set():
        yield


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and _TRITON_ON_CPU.on)


def inductor_launches(op_args: tuple) -> bool:
    """Whether the graph being traced now launches the kernels of an op called with
    ``op_args`` itself (the op traced through) rather than calling the op: when inductor
    traces it (not another backend, not ``torch.export``: they would run or save the traced
    launches as they are), on CUDA, with static shapes (the launch plan is made for concrete
    ones), and for a graph that will not be captured in a CUDA graph (``mode="reduce-overhead"``:
    captured, a call costs its host time once, and the op's own launches keep programmatic
    dependent launch, which inductor's do not have). A plain-compiled step captured by hand
    (:class:`tq_compile.DecodeGraph`) therefore replays inductor's launches."""
    tensors = [a for a in op_args if isinstance(a, torch.Tensor)]
    return (
        compat.inductor_is_tracing()
        and not compat.inductor_cudagraphs()
        and tensors[0].device.type == "cuda"
        and not knobs.runtime.interpret
        and not any(isinstance(n, torch.SymInt) for t in tensors for n in (*t.shape, *t.stride()))
    )


def call(args: NamedTuple):
    """Run the ``torch.ops.tq`` operator whose argument tuple (:mod:`custom_ops.schema`) is
    ``args``, as ``torch.ops.tq.<op>(*args)`` would.

    In eager mode (:func:`is_eager`) on plain CUDA tensors that need no gradient this calls
    the operator's implementation directly: the dispatcher would only route to it, and its
    round trip through a Python kernel costs ~7-10 us of host per call, a fifth of an eager
    decode step's per-layer op time. The call then leaves no ``tq::`` range in a profile and
    does not bump the version counters of the tensors it writes (nothing reads them for a
    cache's buffers). Otherwise (compiling, tracing, a dispatch mode, subclasses, the CPU,
    inputs requiring grad) it calls the operator, which validates the same way."""
    name, impl = _IMPLS[type(args)]
    if is_eager() and not (torch.is_grad_enabled() and _requires_grad(args)):
        key = validate.launch_key(args)  # None unless every tensor is a plain CUDA tensor
        if key is not None:
            return impl(args, key)
    return getattr(torch.ops.tq, name)(*args)


def _requires_grad(args: tuple) -> bool:
    """Whether a tensor of ``args`` requires grad (the operator then tells autograd that it
    has no derivative)."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def is_eager() -> bool:
    """Whether Python code runs here on real tensors, op by op: not compiled or traced by
    dynamo, ``torch.export``, ``make_fx`` (``pre_dispatch`` included) or ``torch.jit``, no
    ``TorchDispatchMode`` (fake tensors, functionalization, a recorder of ops) sees the ops, and
    no functorch transform (``vmap``, ``grad``, ``functionalize``: their wrapped tensors look
    like plain ones to Python)."""
    return (
        not torch.compiler.is_compiling()  # first: dynamo folds it and traces nothing after it
        and compat.len_dispatch_stack() == 0
        and compat.len_pre_dispatch_stack() == 0
        and not compat.jit_tracing_state()
        and not compat.functorch_transforms_active()
    )


def _define(name, args_type, impl, fake, mutates=(), returns="()", traceable=False) -> None:
    """Define ``tq::<name>`` from its argument tuple; ``impl(args, launch_key)`` and
    ``fake(args)`` take that tuple (and ``impl`` its :func:`custom_ops.validate.launch_key`).
    ``traceable``: while functionalization traces a graph for compilation, ``impl`` runs on the
    fake tensors with its launches traced into the graph, where :func:`inductor_launches`
    says so."""
    _lib.define(op_schema(name, args_type, mutates, returns))
    _IMPLS[args_type] = (name, impl)

    def run(*a, **kw):
        args = args_type(*a, **kw)
        return impl(args, validate.launch_key(args))

    _lib.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(
        f"tq::{name}", lambda *a, **kw: fake(args_type(*a, **kw)), lib=_lib
    )
    if not traceable:
        return

    def trace_through(mode, func, types, args, kwargs):
        op_args = args_type(*args, **kwargs)
        if not inductor_launches(op_args):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, traced.traced_launches():
            return impl(op_args, None)

    torch.library.register_torch_dispatch(
        f"tq::{name}", compat.FunctionalTensorMode, trace_through, lib=_lib
    )


def _cache(args) -> PagedKVCache:
    return PagedKVCache(args.k_codes, args.v_codes, args.meta)


def _store(a: StoreArgs, key: validate.LaunchKey | None) -> None:
    kv_format = validate.checked(validate.check_store, a, key)
    if _use_triton(a.key.device):
        triton_store.store(
            kv_format, a.key, a.value, _cache(a), a.slot_mapping, a.rotation, launch_key=key
        )
    else:
        reference.store(kv_format, a.key, a.value, _cache(a), a.slot_mapping, a.rotation)


def _store_window(a: StoreWindowArgs, key: validate.LaunchKey | None) -> torch.Tensor:
    kv_format = validate.checked(validate.check_store_window, a, key)
    args = (
        kv_format,
        a.key,
        a.value,
        _cache(a),
        window_of(a),
        a.block_table,
        a.start_pos,
        a.rotation,
    )
    if _use_triton(a.key.device):
        return triton_store_window.store_window(*args, launch_key=key)
    return reference.store_window(*args)


def _dequantize(
    a: DequantizeArgs, key: validate.LaunchKey | None
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_format, _ = validate.checked(validate.check_dequantize, a, key)
    impl = triton_dequant.dequantize if _use_triton(a.k_codes.device) else reference.dequantize
    return impl(
        kv_format,
        _cache(a),
        a.block_table,
        a.seq_lens,
        a.rotation,
        a.max_seq_len,
        a.dtype,
        window_of(a),
    )


def _dequantize_fake(a: DequantizeArgs) -> tuple[torch.Tensor, torch.Tensor]:
    _, head_dim = validate.check_dequantize(a)
    shape = (a.block_table.shape[0], a.k_codes.shape[1], a.max_seq_len, head_dim)
    return a.k_codes.new_empty(shape, dtype=a.dtype), a.k_codes.new_empty(shape, dtype=a.dtype)


def _decode(a: DecodeArgs, key: validate.LaunchKey | None) -> torch.Tensor:
    kv_format = validate.checked(validate.check_decode, a, key)
    if _use_triton(a.q.device):
        return triton_decode(
            kv_format,
            a.q,
            _cache(a),
            a.block_table,
            a.seq_lens,
            a.rotation,
            a.num_splits,
            a.scale,
            a.mask,
            window_of(a),
            a.softcap,
            launch_key=key,
        )
    return reference.decode(
        kv_format,
        a.q,
        _cache(a),
        a.block_table,
        a.seq_lens,
        a.rotation,
        a.scale,
        torch.float32,
        a.mask,
        window_of(a),
        a.softcap,
    )


def _decode_step(
    a: DecodeStepArgs, key: validate.LaunchKey | None
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_format = validate.checked(validate.check_decode_step, a, key)
    common = (kv_format, a.q, a.key, a.value, _cache(a), a.block_table, a.start_pos, a.rotation)
    if _use_triton(a.q.device):
        return triton_decode_step(
            *common,
            a.num_splits,
            a.scale,
            window_of(a),
            a.mask,
            a.softcap,
            launch_key=key,
        )
    return reference.decode_step(*common, a.scale, window_of(a), torch.float32, a.mask, a.softcap)


def _decode_step_fake(a: DecodeStepArgs) -> tuple[torch.Tensor, torch.Tensor]:
    validate.check_decode_step(a)
    return a.q.new_empty(a.q.shape), a.q.new_empty(a.q.shape[0], dtype=torch.int32)


def _decode_fake(a: DecodeArgs) -> torch.Tensor:
    validate.check_decode(a)
    return a.q.new_empty(a.q.shape)  # contiguous, as both implementations return


def _prefill(a: PrefillArgs, key: validate.LaunchKey | None) -> torch.Tensor:
    kv_format = validate.checked(validate.check_prefill, a, key)
    args = (
        kv_format,
        a.q,
        a.key,
        a.value,
        _cache(a),
        a.block_table,
        a.seq_lens,
        a.rotation,
        a.scale,
        a.is_causal,
        a.max_seq_len,
    )
    if _use_triton(a.q.device) and not a.softcap:
        out = triton_prefill.prefill(*args, a.mask, window_of(a))
    elif not a.softcap and reference.chunk_is_everything(
        a.seq_lens, a.q.shape[2], a.is_causal, a.max_seq_len, a.mask
    ):
        # a first chunk: what the dense model computes, by the same kernel (the CPU's flash)
        causal = a.is_causal or a.mask is not None
        out = sdpa_lse.attention_lse(a.q, a.key, a.value, causal, a.scale)[0]
    else:
        # the CPU; and capped scores on any device (Gemma 2's prompts: neither the dense SDPA
        # of the chunk nor the fused prefix kernel caps), in query blocks of the reference
        out = reference.prefill(*args, torch.float32, a.mask, window_of(a), a.softcap)
    return _laid_out_like(out, a.q)


def _laid_out_like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` with the strides of ``torch.empty_like(q)`` (the prefill's output layout: q's
    own for a dense q, so that a model's ``transpose(1, 2).contiguous()`` of SDPA's output,
    as cuDNN and flash lay it out, stays free); a copy only where they differ."""
    like = torch.empty_like(q, device="meta").stride()
    if all(n == 1 or a == b for n, a, b in zip(out.shape, out.stride(), like, strict=True)):
        return out.as_strided(out.shape, like)  # strides of size-1 dims address nothing
    return torch.empty_like(q).copy_(out)


def _prefill_fake(a: PrefillArgs) -> torch.Tensor:
    validate.check_prefill(a)
    return torch.empty_like(a.q)  # the layout both implementations return


def _store_fake(a: StoreArgs) -> None:
    validate.check_store(a)


def _store_window_fake(a: StoreWindowArgs) -> torch.Tensor:
    validate.check_store_window(a)
    return a.key.new_empty(a.key.shape[0], dtype=torch.int32)


_define(
    "store", StoreArgs, _store, _store_fake, mutates=("k_codes", "v_codes", "meta"), traceable=True
)
_define(
    "store_window",
    StoreWindowArgs,
    _store_window,
    _store_window_fake,
    mutates=("k_codes", "v_codes", "meta", "k_window", "v_window", "window_pos", "key_center"),
    returns="Tensor",
    traceable=True,
)
_define("dequantize", DequantizeArgs, _dequantize, _dequantize_fake, returns="(Tensor, Tensor)")
_define("decode", DecodeArgs, _decode, _decode_fake, returns="Tensor", traceable=True)
_define(
    "decode_step",
    DecodeStepArgs,
    _decode_step,
    _decode_step_fake,
    mutates=("k_codes", "v_codes", "meta", "k_window", "v_window", "window_pos"),
    returns="(Tensor, Tensor)",
    traceable=True,
)
_define("prefill", PrefillArgs, _prefill, _prefill_fake, returns="Tensor")
traced.static_launch_by_default()
