"""Input checks shared by the ops: run before any kernel, so bad input never touches a cache.

Metadata (dtype, shape, device, layout) is always checked, also on fake tensors while tracing.
Checks of tensor *values* (slots and lengths against capacity, page ids) read device data: they
run on CPU tensors, and on CUDA tensors only when ``TQ_CHECK_VALUES=1`` and no CUDA graph is
being captured, because a host sync per decode step is what this library exists to avoid. With
the check off, the CUDA kernels still never write out of bounds: they skip slots beyond capacity
and clamp lengths to the block table's capacity.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import NamedTuple

import torch

from custom_ops import compat, formats, reference, splits
from custom_ops.formats import KVFormat, PagedKVCache, get_format
from custom_ops.schema import (
    DecodeArgs,
    DecodeStepArgs,
    DequantizeArgs,
    PrefillArgs,
    StoreArgs,
    StoreWindowArgs,
)
from custom_ops.triton.decode.plan import step_supported
from custom_ops.triton.launch import KeyedMemo

MODEL_DTYPES = (torch.bfloat16, torch.float16)
# Query tokens per sequence one decode attends with (a verify step of speculative decoding).
MAX_QUERY_TOKENS = 16
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _fail(op: str, message: str, error: type[Exception] = ValueError) -> None:
    raise error(f"tq.{op}: {message}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def checks_values(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` may be read here (see the module docstring)."""
    if type(t) is torch.Tensor and t.is_cuda:  # an eager step's case, without is_fake's cost
        return _check_values_env()
    if compat.is_fake(t) or t.device.type == "meta":
        return False
    if t.device.type == "cpu":
        return True
    return _check_values_env()


def _check_values_env() -> bool:
    """``TQ_CHECK_VALUES=1`` and no CUDA graph being captured."""
    if os.environ.get("TQ_CHECK_VALUES") != "1":
        return False
    return not torch.cuda.is_current_stream_capturing()


# Results of checks that looked at metadata only, by the metadata of their arguments.
_CHECKED = KeyedMemo()
# Every launch key made, by itself: each call's key is replaced by the first equal one.
_KEYS = KeyedMemo()
# launch_key's entries of tensors whose metadata is fixed (fix_metadata), by id, with a weak
# reference to the tensor (a dead tensor's id may be reused)
_FIXED: dict[int, tuple[weakref.ref, tuple]] = {}


def fix_metadata(*tensors: torch.Tensor) -> None:
    """Declare that the shape, strides, dtype, device and storage of ``tensors`` never change
    in place (a cache module's own buffers: replaced by new tensors when the module moves,
    never resized): :func:`launch_key` then reads their entries from a memo, not from each
    tensor at every op call (five reads per tensor, ~1 us of host each tensor)."""
    for t in tensors:
        if type(t) is torch.Tensor and id(t) not in _FIXED:
            _FIXED[id(t)] = (weakref.ref(t, functools.partial(_unfix, id(t))), _entry(t))


def _unfix(tensor_id: int, _ref) -> None:
    _FIXED.pop(tensor_id, None)


def _entry(t: torch.Tensor) -> tuple:
    """A plain tensor's items of a launch key. The alignment is what Triton specializes a
    pointer on; ``get_device()`` is -1 for CPU and meta tensors, which the same-device checks
    reject before a key is kept."""
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)


class LaunchKey:
    """A :func:`launch_key`: the tuple of an op call's argument metadata, hashed once.

    An eager op call looks its key up in four or five memos (its checks, its plan, each
    kernel's compiled handle), and a tuple of ~60 items hashes all of them again at each
    lookup (a tuple keeps no hash). Keys are interned, so those lookups also find the very
    object they hold and compare nothing."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple):
        self.items, self._hash = items, hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            type(other) is LaunchKey and self._hash == other._hash and self.items == other.items
        )

    def __repr__(self) -> str:
        return f"LaunchKey{self.items!r}"


def launch_key(args: tuple) -> LaunchKey | None:
    """The metadata of an op's arguments ``args`` (per tensor: shape, strides, dtype, device
    index and 16-byte alignment; other values as they are), or None where the checks read
    tensor values (see :func:`checks_values`) or a tensor is not a plain CUDA tensor (fake and
    functional tensors, CPU, subclasses).

    Everything an op's checks, launch plan and kernel specializations depend on is a function
    of this key: the ops remember the checks' result by it (:func:`checked`), and their
    launchers the compiled kernels (:class:`custom_ops.triton.launch.Launcher`). An eager
    decode step computes it once per op call, so it is written for speed."""
    first = args[0]
    if type(first) is not torch.Tensor or not first.is_cuda or _check_values_env():
        return None
    key = []
    for value in args:
        if type(value) is torch.Tensor:
            fixed = _FIXED.get(id(value))
            key += fixed[1] if fixed is not None and fixed[0]() is value else _entry(value)
        elif isinstance(value, torch.Tensor):
            return None  # a subclass (a Parameter...): checked every call
        else:
            key.append(value)  # None or a plain value
    made = LaunchKey(tuple(key))
    return _KEYS.get(made, lambda: made)


def checked(check, args: tuple, key: LaunchKey | None):
    """``check(args)``, or its result for earlier arguments of the same :func:`launch_key`
    ``key`` (None: always check). Metadata checks are a function of the metadata alone, so an
    eager decode step pays for them once, not per call (a few microseconds instead of ~100)."""
    return _CHECKED.get(None if key is None else (check, key), lambda: check(args))


def check_format(op: str, fmt: str) -> KVFormat:
    try:
        return get_format(fmt)
    except ValueError as err:
        _fail(op, str(err))


def check_same_device(op: str, device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            _fail(
                op,
                f"{name} is on {t.device} but the cache is on {device}: expected every "
                "tensor on the cache's device",
            )


def check_head_dim(op: str, head_dim: int) -> None:
    try:
        formats.check_head_dim(head_dim)
    except ValueError as err:
        _fail(op, str(err))


def check_cache(op: str, fmt: KVFormat, cache: PagedKVCache, head_dim: int) -> None:
    """The planes must have exactly the format's shapes and dtypes, and be contiguous."""
    if cache.k_codes.dim() != 4:
        _fail(
            op,
            f"k_codes must be [num_pages, Hk, page_size, bytes], got shape "
            f"{_shape(cache.k_codes)}",
        )
    num_pages, num_kv_heads, page_size = cache.k_codes.shape[:3]
    if num_kv_heads < 1 or page_size < 1:
        _fail(
            op,
            f"k_codes must have at least one kv head and one slot per page, got shape "
            f"{_shape(cache.k_codes)}",
        )
    expected = fmt.plane_shapes(num_pages, num_kv_heads, page_size, head_dim)
    for name, plane in zip(cache._fields, cache, strict=True):
        shape, dtype = expected[name]
        if plane.dtype != dtype:
            _fail(
                op, f"{name} of a {fmt.name} cache must be {dtype}, got {plane.dtype}", TypeError
            )
        if _shape(plane) != shape:
            _fail(
                op,
                f"{name} of a {fmt.name} cache with head dim {head_dim} must have shape "
                f"{shape}, got {_shape(plane)}",
            )
        if not plane.is_contiguous():
            _fail(op, f"{name} must be contiguous")
    check_same_device(op, cache.k_codes.device, v_codes=cache.v_codes, meta=cache.meta)


def check_rotation(op: str, rotation: torch.Tensor, head_dim: int, device: torch.device) -> None:
    if rotation.dtype != torch.float32:
        _fail(op, f"rotation must be float32, got {rotation.dtype}", TypeError)
    if _shape(rotation) != (head_dim, head_dim) or not rotation.is_contiguous():
        _fail(
            op,
            f"rotation must be a contiguous [{head_dim}, {head_dim}] matrix, got shape "
            f"{_shape(rotation)}",
        )
    check_same_device(op, device, rotation=rotation)


def check_int32_vector(op: str, name: str, t: torch.Tensor, length: int | None = None) -> None:
    if t.dtype != torch.int32:
        _fail(op, f"{name} must be int32, got {t.dtype}", TypeError)
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"[{length}]" if length is not None else "1-D"
        _fail(op, f"{name} must have shape {want}, got {_shape(t)}")
    if t.shape[0] > 1 and t.stride(0) != 1:  # the kernels read entry b at b
        _fail(op, f"{name} must be contiguous, got stride {t.stride(0)}")


def check_position_vector(op: str, name: str, t: torch.Tensor, length: int) -> None:
    """An int32 or int64 ``[length]`` tensor of any stride (a model's ``input_pos[:1].expand(B)``
    passes as it is: the kernels read entry ``b`` at ``b * stride``)."""
    if t.dtype not in (torch.int32, torch.int64):
        _fail(op, f"{name} must be int32 or int64, got {t.dtype}", TypeError)
    if t.dim() != 1 or t.shape[0] != length:
        _fail(op, f"{name} must have shape [{length}], got {_shape(t)}")


def check_new_tokens(
    op: str,
    fmt: KVFormat,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    layout: str,
) -> None:
    """New keys and values of shape ``layout`` (kv-heads in dim 1, head dim last),
    bf16/fp16, matching the cache's kv-heads and head dim."""
    if key.dim() != layout.count(",") + 1:
        _fail(op, f"key must be {layout}, got shape {_shape(key)}")
    if key.dtype not in MODEL_DTYPES:
        _fail(op, f"key must be bfloat16 or float16, got {key.dtype}", TypeError)
    if value.dtype != key.dtype:
        _fail(op, f"value must have the key's dtype {key.dtype}, got {value.dtype}", TypeError)
    if _shape(value) != _shape(key):
        _fail(op, f"value must have the key's shape {_shape(key)}, got {_shape(value)}")
    num_kv_heads, head_dim = key.shape[1], key.shape[-1]
    check_head_dim(op, head_dim)
    cache_head_dim = cache.k_codes.shape[-1] * 8 // fmt.key.bits
    if cache.k_codes.dim() == 4 and cache_head_dim != head_dim:
        _fail(
            op,
            f"key has head dim {head_dim} but the {fmt.name} cache holds head dim "
            f"{cache_head_dim} (k_codes rows of {cache.k_codes.shape[-1]} bytes)",
        )
    check_cache(op, fmt, cache, head_dim)
    if cache.k_codes.shape[1] != num_kv_heads:
        _fail(op, f"key has {num_kv_heads} kv-heads but the cache has {cache.k_codes.shape[1]}")


def check_store(args: StoreArgs) -> KVFormat:
    """Checks of ``tq.store``; returns the format."""
    op = "store"
    fmt = check_format(op, args.fmt)
    cache = PagedKVCache(args.k_codes, args.v_codes, args.meta)
    key, slot_mapping = args.key, args.slot_mapping
    check_new_tokens(op, fmt, key, args.value, cache, "[N, Hk, D]")
    n_tokens, _, head_dim = key.shape
    device = cache.k_codes.device
    check_same_device(op, device, key=key, value=args.value, slot_mapping=slot_mapping)
    check_int32_vector(op, "slot_mapping", slot_mapping, n_tokens)
    check_rotation(op, args.rotation, head_dim, device)
    if n_tokens and checks_values(slot_mapping):
        capacity = cache.k_codes.shape[0] * cache.k_codes.shape[2]
        largest = int(slot_mapping.max())
        if largest >= capacity:
            _fail(
                op,
                f"slot {largest} is beyond the cache's capacity of {capacity} slots "
                "(num_pages * page_size); expected slots in [0, capacity) or < 0 for "
                "padding",
            )
    return fmt


def check_store_window(args: StoreWindowArgs, op: str = "store_window") -> KVFormat:
    """Checks of ``tq.store_window`` (``op``: the operator named in errors); returns the
    format."""
    fmt = check_format(op, args.fmt)
    cache = PagedKVCache(args.k_codes, args.v_codes, args.meta)
    key, block_table, start_pos = args.key, args.block_table, args.start_pos
    check_new_tokens(op, fmt, key, args.value, cache, "[B, Hk, T, D]")
    batch, num_kv_heads, n_new, head_dim = key.shape
    device = cache.k_codes.device
    check_same_device(op, device, key=key, value=args.value, start_pos=start_pos)
    check_window(op, args, batch, num_kv_heads, head_dim, device)
    if args.k_window is not None and key.dtype != args.k_window.dtype:
        # the ring would hold a cast of the keys (bfloat16 keys near 1e5 are inf in float16)
        _fail(
            op,
            f"key must have the rings' dtype {args.k_window.dtype} (the model's), got {key.dtype}",
            TypeError,
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < batch:
        _fail(
            op,
            f"block_table must be int32 [>= {batch}, max_pages], got {block_table.dtype} "
            f"{_shape(block_table)}",
        )
    check_same_device(op, device, block_table=block_table)
    check_position_vector(op, "start_pos", start_pos, batch)
    check_rotation(op, args.rotation, head_dim, device)
    check_key_center(op, args.key_center, args.k_window, device)
    if batch and checks_values(start_pos):
        window = formats.ring_window(args.k_window, args.sinks)
        capacity = formats.sequence_capacity(block_table.shape[1], cache.k_codes.shape[2], window)
        end = int(start_pos.max()) + n_new
        if end > capacity:
            _fail(
                op,
                f"tokens up to position {end - 1} do not fit a sequence's capacity of "
                f"{capacity} positions (block_table pages * page_size + window)",
            )
        # every live sequence's pages up to the last position that can leave the ring
        # each live sequence's pages up to the last of its positions that can leave the ring:
        # a short sequence's table may end in padding that a longer one's end would reach
        written = torch.where(start_pos >= 0, (start_pos + n_new - window).clamp_min(0), 0)
        check_page_ids(op, cache, block_table[:batch], written, "start_pos + T - window")
    return fmt


def check_window(
    op: str, args: NamedTuple, batch: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> None:
    """The recent-window rings of op arguments ``args`` (flat, as the schemas take them):
    ``k_window``, ``v_window`` ``[>= B, Hk, W + sinks, D]`` bf16/fp16 and their slots'
    positions ``window_pos [same B, Hk, W + sinks] int32``, all contiguous; ``sinks >= 0``, and
    0 without rings. (Checked flat: a window bundle could not hold the inconsistent inputs that
    must be refused.)"""
    k_window, v_window, window_pos, sinks = (
        args.k_window,
        args.v_window,
        args.window_pos,
        args.sinks,
    )
    if not (k_window is None) == (v_window is None) == (window_pos is None):
        _fail(op, "k_window, v_window and window_pos must be given together")
    if type(sinks) is not int or sinks < 0:
        _fail(op, f"sinks must be an integer >= 0, got {sinks!r}")
    if k_window is None:
        if sinks:
            _fail(
                op,
                f"sinks={sinks} needs the rings (k_window, v_window, window_pos) that hold them",
            )
        return
    if k_window.dtype not in MODEL_DTYPES or v_window.dtype != k_window.dtype:
        _fail(
            op,
            f"k_window and v_window must be bfloat16 or float16 of one dtype, got "
            f"{k_window.dtype} and {v_window.dtype}",
            TypeError,
        )
    shape = _shape(k_window)
    if (
        len(shape) != 4
        or shape[0] < batch
        or shape[1] != num_kv_heads
        or shape[2] < max(1, sinks)
        or shape[3] != head_dim
        or _shape(v_window) != shape
    ):
        _fail(
            op,
            f"k_window and v_window must be [>= {batch}, {num_kv_heads}, W + sinks >= "
            f"{max(1, sinks)}, {head_dim}] (batch, kv-heads, window slots + sinks={sinks}, "
            f"head dim), got {shape} and {_shape(v_window)}",
        )
    if not (k_window.is_contiguous() and v_window.is_contiguous()):
        _fail(op, "k_window and v_window must be contiguous")
    if window_pos.dtype != torch.int32:
        _fail(op, f"window_pos must be int32, got {window_pos.dtype}", TypeError)
    if _shape(window_pos) != shape[:3] or not window_pos.is_contiguous():
        _fail(
            op,
            f"window_pos must be a contiguous {list(shape[:3])} (the rings' batch, kv-heads and "
            f"slots), got {_shape(window_pos)}"
            f"{'' if window_pos.is_contiguous() else ' with strides ' + str(window_pos.stride())}",
        )
    check_same_device(op, device, k_window=k_window, v_window=v_window, window_pos=window_pos)
    if checks_values(window_pos):
        check_ring_positions(op, window_pos, sinks)


def check_key_center(
    op: str, key_center: torch.Tensor | None, k_window: torch.Tensor | None, device: torch.device
) -> None:
    """The keys' centres ``key_center``, if given: a contiguous float32 ``[B, Hk, D]`` of the
    rings' batch, kv-heads and head dim (checked first)."""
    if key_center is None:
        return
    if k_window is None:
        _fail(
            op,
            "key_center needs the rings (k_window, v_window, window_pos): the centre is "
            "set from the keys a sequence holds before any is quantized",
        )
    if key_center.dtype != torch.float32:
        _fail(op, f"key_center must be float32, got {key_center.dtype}", TypeError)
    shape = (k_window.shape[0], k_window.shape[1], k_window.shape[3])
    if _shape(key_center) != shape or not key_center.is_contiguous():
        strides = "" if key_center.is_contiguous() else f" with strides {key_center.stride()}"
        _fail(
            op,
            f"key_center must be a contiguous {list(shape)} (the rings' batch, kv-heads and "
            f"head dim), got {_shape(key_center)}{strides}",
        )
    check_same_device(op, device, key_center=key_center)


def check_ring_positions(op: str, window_pos: torch.Tensor, sinks: int) -> None:
    """Each slot of ``window_pos [B, Hk, W + sinks]`` holds -1 or a position the ops put
    there: a window slot ``s`` a position ``p >= sinks`` with ``p % W == s``, a sink slot ``W +
    p`` its own ``p`` (rings written with another sink count fail here, not silently)."""
    window = formats.ring_window(window_pos, sinks)
    slots = torch.arange(window_pos.shape[2], device=window_pos.device)
    held = window_pos.to(torch.int64)
    in_place = (reference.ring_slots(held.clamp_min(0), window, sinks) == slots) & (
        (held < sinks) == (slots >= window)
    )
    bad = (held != -1) & ~((held >= 0) & in_place)
    if bad.any():
        b, h, s = (int(i) for i in bad.nonzero()[0])
        _fail(
            op,
            f"window_pos[{b}, {h}, {s}] = {int(window_pos[b, h, s])} is not a position "
            f"that slot {s} of a ring of {window} window slots and sinks={sinks} holds "
            "(-1, a position p >= sinks with p % window == slot, or a sink slot's own "
            "p = slot - window)",
        )


def check_block_table(
    op: str,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int | None = None,
    rings: NamedTuple | None = None,
) -> None:
    """``block_table [B, P] int32`` and ``seq_lens [B] int32`` against the cache's pages.

    With a recent window of ``W`` tokens (the op arguments ``rings``' ``k_window``, ``sinks``
    and ``window_pos``, checked by :func:`check_window`) a sequence holds ``P * page_size + W``
    positions: only those below its ring run (:func:`custom_ops.reference.ring_start`) live in
    pages (the first ``sinks`` of them aside: their pages are read but never used).
    """
    k_window, window_pos, sinks = (
        (None, None, 0)
        if rings is None
        else (
            rings.k_window,
            rings.window_pos,
            rings.sinks,
        )
    )
    window = formats.ring_window(k_window, sinks)
    if block_table.dtype != torch.int32:
        _fail(op, f"block_table must be int32, got {block_table.dtype}", TypeError)
    if block_table.dim() != 2:
        _fail(op, f"block_table must be [B, max_pages], got shape {_shape(block_table)}")
    batch, max_pages = block_table.shape
    check_int32_vector(op, "seq_lens", seq_lens, batch)
    check_same_device(op, cache.k_codes.device, block_table=block_table, seq_lens=seq_lens)
    table_capacity = formats.sequence_capacity(max_pages, cache.k_codes.shape[2], window)
    if max_seq_len is not None and not 0 <= max_seq_len <= table_capacity:
        _fail(
            op,
            f"max_seq_len {max_seq_len} must be in [0, {table_capacity}] "
            f"(block_table pages * page_size{' + window' if window else ''})",
        )
    if batch == 0 or not checks_values(seq_lens):
        return
    bound = table_capacity if max_seq_len is None else max_seq_len
    longest = int(seq_lens.max())
    if longest > bound or int(seq_lens.min()) < 0:
        _fail(
            op,
            f"seq_lens must be in [0, {bound}], got a length of "
            f"{longest if longest > bound else int(seq_lens.min())}",
        )
    if k_window is None:
        check_page_ids(op, cache, block_table, seq_lens, "seq_lens")
        return
    paged = reference.ring_start(window_pos, seq_lens, sinks).amax(dim=1)
    check_page_ids(op, cache, block_table, paged, "the start of its window run")


def check_page_ids(
    op: str, cache: PagedKVCache, block_table: torch.Tensor, lengths: torch.Tensor, what: str
) -> None:
    """The page ids of ``block_table [B, P]`` that hold positions below ``lengths [B]`` must
    name pages of the cache; each sequence is checked up to its own length (``what`` names
    those lengths in the error). Entries past them may hold anything."""
    num_pages, _, page_size = cache.k_codes.shape[:3]
    first_position = torch.arange(block_table.shape[1], device=lengths.device) * page_size
    needed = first_position[None, :] < lengths[:, None]
    bad = needed & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, p = (int(i) for i in bad.nonzero()[0])
        _fail(
            op,
            f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a page id in [0, "
            f"{num_pages}), but sequence {b} keeps its positions below {what} = "
            f"{int(lengths[b])} in pages",
        )


def check_dequantize(args: DequantizeArgs) -> tuple[KVFormat, int]:
    """Checks of ``tq.dequantize``; returns the format and the head dim."""
    op = "dequantize"
    kv_format = check_format(op, args.fmt)
    rotation = args.rotation
    head_dim = rotation.shape[0] if rotation.dim() == 2 else -1
    check_head_dim(op, head_dim)
    cache = PagedKVCache(args.k_codes, args.v_codes, args.meta)
    device = cache.k_codes.device
    check_cache(op, kv_format, cache, head_dim)
    check_rotation(op, rotation, head_dim, device)
    block_table = args.block_table
    batch = block_table.shape[0] if block_table.dim() == 2 else 0
    num_kv_heads = cache.k_codes.shape[1]
    check_window(op, args, batch, num_kv_heads, head_dim, device)
    check_block_table(op, cache, block_table, args.seq_lens, args.max_seq_len, args)
    check_key_center(op, args.key_center, args.k_window, device)
    if args.dtype not in OUTPUT_DTYPES:
        _fail(op, f"dtype must be one of {OUTPUT_DTYPES}, got {args.dtype}", TypeError)
    return kv_format, head_dim


def check_scores(op: str, scale, softcap) -> None:
    """Check the softmax ``scale`` (a positive finite float) and the logit ``softcap`` (0 for
    none, else a positive finite float)."""
    if not (scale > 0 and scale != float("inf")):
        _fail(op, f"scale must be a positive finite float, got {scale}")
    if not (softcap >= 0 and softcap != float("inf")):
        _fail(op, f"softcap must be 0 (no cap) or a positive finite float, got {softcap}")


def check_decode(args: DecodeArgs, op: str = "decode") -> KVFormat:
    """Checks of ``tq.decode`` (``op``: the operator named in errors); returns the format."""
    fmt = check_format(op, args.fmt)
    q, mask = args.q, args.mask
    if q.dim() not in (3, 4) or (q.dim() == 4 and not 1 <= q.shape[2] <= MAX_QUERY_TOKENS):
        _fail(
            op,
            f"q must be [B, Hq, D] (one query token per sequence) or [B, Hq, T, D] with "
            f"1 <= T <= {MAX_QUERY_TOKENS} (each sequence's last T tokens), got shape "
            f"{_shape(q)}",
        )
    if q.dtype not in MODEL_DTYPES:
        _fail(op, f"q must be bfloat16 or float16, got {q.dtype}", TypeError)
    batch, num_q_heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    check_head_dim(op, head_dim)
    cache = PagedKVCache(args.k_codes, args.v_codes, args.meta)
    device = cache.k_codes.device
    check_cache(op, fmt, cache, head_dim)
    num_kv_heads = cache.k_codes.shape[1]
    if num_q_heads % num_kv_heads:
        _fail(
            op, f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv-heads"
        )
    check_same_device(op, device, q=q)
    check_rotation(op, args.rotation, head_dim, device)
    check_window(op, args, batch, num_kv_heads, head_dim, device)
    check_block_table(op, cache, args.block_table, args.seq_lens, None, args)
    if args.block_table.shape[0] != batch:
        _fail(
            op, f"block_table has {args.block_table.shape[0]} rows for a batch of {batch} queries"
        )
    if not splits.is_valid_num_splits(args.num_splits):
        _fail(
            op,
            f"num_splits must be a power of two in [1, {splits.MAX_SPLITS}], got "
            f"{args.num_splits}",
        )
    check_scores(op, args.scale, args.softcap)
    if mask is not None:
        check_same_device(op, device, mask=mask)
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            _fail(op, f"mask must be bool or floating point, got {mask.dtype}", TypeError)
        tokens_ok = mask.dim() == 3 or (
            q.dim() == 4 and mask.dim() == 4 and mask.shape[2] == q.shape[2]
        )
        heads_ok = mask.dim() >= 3 and mask.shape[1] in (1, num_q_heads)
        if not (tokens_ok and heads_ok) or mask.shape[0] not in (1, batch):
            per_token = f" or [{batch} or 1, {num_q_heads} or 1, {q.shape[2]}, M]"
            _fail(
                op,
                f"mask must be [B or 1, Hq or 1, positions] = [{batch} or 1, "
                f"{num_q_heads} or 1, M]{per_token if q.dim() == 4 else ''}, got shape "
                f"{_shape(mask)}",
            )
    return fmt


def check_decode_step(args: DecodeStepArgs) -> KVFormat:
    """Checks of ``tq.decode_step``: its tokens, positions and rings as ``tq.store_window``'s
    (one token), its query and the pages it reads as ``tq.decode``'s at the lengths before the
    step, then what the fused step needs: a format and window it serves and a contiguous head
    dim.

    Returns:
        The format.

    Raises:
        ValueError, TypeError: an argument the step cannot take, named with its value and
            what is allowed.
    """
    op = "decode_step"
    q, key, value = args.q, args.key, args.value
    if q.dim() != 3:
        _fail(op, f"q must be [B, Hq, D] (one query token per sequence), got shape {_shape(q)}")
    if key.dim() != 4 or key.shape[2] != 1:
        _fail(op, f"key must be [B, Hk, 1, D] (the step's token), got shape {_shape(key)}")
    fmt = check_store_window(
        StoreWindowArgs(
            key,
            value,
            args.k_codes,
            args.v_codes,
            args.meta,
            args.k_window,
            args.v_window,
            args.window_pos,
            args.block_table,
            args.start_pos,
            args.rotation,
            args.fmt,
            args.sinks,
        ),
        op,
    )
    batch = key.shape[0]
    if q.shape[0] != batch:
        _fail(op, f"q has {q.shape[0]} sequences but key has {batch}")
    # the attention reads the cache below each start: its pages are the decode's at that length
    lengths = args.start_pos.clamp_min(0).to(torch.int32)
    check_decode(
        DecodeArgs(
            q,
            args.k_codes,
            args.v_codes,
            args.meta,
            args.block_table[:batch],
            lengths,
            args.rotation,
            args.fmt,
            args.num_splits,
            args.scale,
            args.mask,
            args.k_window,
            args.v_window,
            args.window_pos,
            args.sinks,
            args.softcap,
        ),
        op,
    )
    window = formats.ring_window(args.k_window, args.sinks)
    if not step_supported(fmt, window, 1):
        why = (
            f"{fmt.name}'s values are rotated (the ring kernel reads their ring)"
            if fmt.value.rotated
            else f"the rings hold no recent window (window {window}, sinks {args.sinks})"
        )
        _fail(
            op,
            f"a fused decode step needs a recent window and values in the original space: "
            f"{why}; use tq.store_window and tq.decode",
        )
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1:
            _fail(op, f"{name} must have a contiguous head dim (stride 1), got {t.stride()}")
    return fmt


def check_prefill(args: PrefillArgs) -> KVFormat:
    """Checks of ``tq.prefill``; returns the format."""
    op = "prefill"
    fmt = check_format(op, args.fmt)
    q, key, mask = args.q, args.key, args.mask
    if q.dim() != 4:
        _fail(op, f"q must be [B, Hq, T, D] (the chunk's query tokens), got shape {_shape(q)}")
    if q.dtype not in MODEL_DTYPES:
        _fail(op, f"q must be bfloat16 or float16, got {q.dtype}", TypeError)
    batch, num_q_heads, tokens, head_dim = q.shape
    if tokens < 1:
        _fail(op, f"q must hold at least one query token (T >= 1), got shape {_shape(q)}")
    cache = PagedKVCache(args.k_codes, args.v_codes, args.meta)
    check_new_tokens(op, fmt, key, args.value, cache, "[B, Hk, T, D]")
    if key.dtype != q.dtype:
        _fail(op, f"key must have q's dtype {q.dtype}, got {key.dtype}", TypeError)
    num_kv_heads = key.shape[1]
    if (key.shape[0], key.shape[2], key.shape[3]) != (batch, tokens, head_dim):
        _fail(
            op,
            f"key must be [B, Hk, T, D] = [{batch}, Hk, {tokens}, {head_dim}] (q's batch, "
            f"tokens and head dim), got {_shape(key)}",
        )
    if num_q_heads % num_kv_heads:
        _fail(
            op, f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv-heads"
        )
    if q.stride(-1) != 1 or key.stride(-1) != 1 or args.value.stride(-1) != 1:
        _fail(op, "q, key and value must be contiguous in the head dim (stride 1)")
    device = cache.k_codes.device
    check_same_device(op, device, q=q, key=key, value=args.value)
    check_rotation(op, args.rotation, head_dim, device)
    check_window(op, args, batch, num_kv_heads, head_dim, device)
    if args.k_window is not None and args.k_window.dtype != q.dtype:
        _fail(
            op,
            f"k_window and v_window must have q's dtype {q.dtype} (the model's), got "
            f"{args.k_window.dtype}",
            TypeError,
        )
    check_block_table(op, cache, args.block_table, args.seq_lens, None, args)
    if args.block_table.shape[0] != batch:
        _fail(op, f"block_table has {args.block_table.shape[0]} rows for a batch of {batch}")
    check_key_center(op, args.key_center, args.k_window, device)
    check_scores(op, args.scale, args.softcap)
    if type(args.is_causal) is not bool:
        _fail(op, f"is_causal must be a bool, got {args.is_causal!r}", TypeError)
    if type(args.max_seq_len) is not int or args.max_seq_len < 0:
        _fail(op, f"max_seq_len must be an integer >= 0, got {args.max_seq_len!r}")
    if mask is not None:
        check_same_device(op, device, mask=mask)
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            _fail(op, f"mask must be bool or floating point, got {mask.dtype}", TypeError)
        if (
            mask.dim() != 4
            or mask.shape[0] not in (1, batch)
            or mask.shape[1] not in (1, num_q_heads)
            or mask.shape[2] != tokens
        ):
            _fail(
                op,
                f"mask must be [B or 1, Hq or 1, T, M] = [{batch} or 1, {num_q_heads} or "
                f"1, {tokens}, M], got shape {_shape(mask)}",
            )
    if batch and tokens and checks_values(args.seq_lens):
        shortest = int(args.seq_lens.min())
        if shortest < tokens:
            _fail(
                op,
                f"seq_lens must be at least T = {tokens} (the chunk is each sequence's "
                f"last T positions, stored before), got a length of {shortest}",
            )
    return fmt
