"""The argument list of every ``torch.ops.tq`` operator, written once.

Each operator's arguments are a ``NamedTuple`` here: :mod:`custom_ops.ops` derives the
operator's schema from it (:func:`op_schema`), its real and fake implementations receive one,
:mod:`custom_ops.validate` checks one and :mod:`custom_ops.api` builds one. The docstrings of the
operators are in :mod:`custom_ops.ops`.

A recent window (:class:`~custom_ops.formats.RecentWindow`) is one argument everywhere but
here: a schema takes tensors, ints and optionals, not a tuple of them, so an op's arguments
list the window's fields flat under the window's own names. :func:`window_fields` flattens a
window into them and :func:`window_of` gathers it back, the two halves of that one mapping.
"""

import functools
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from custom_ops.formats import RecentWindow

__all__ = [
    "StoreArgs",
    "StoreWindowArgs",
    "DequantizeArgs",
    "DecodeArgs",
    "DecodeStepArgs",
    "PrefillArgs",
    "op_schema",
    "window_fields",
    "window_of",
]


class StoreArgs(NamedTuple):
    """``tq.store``: quantize new token-heads into the slots of a paged cache."""

    key: Tensor
    value: Tensor
    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    slot_mapping: Tensor
    rotation: Tensor
    fmt: str


class StoreWindowArgs(NamedTuple):
    """``tq.store_window``: append tokens to sequences with a full-precision recent window."""

    key: Tensor
    value: Tensor
    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    k_window: Tensor
    v_window: Tensor
    window_pos: Tensor
    block_table: Tensor
    start_pos: Tensor
    rotation: Tensor
    fmt: str
    sinks: int = 0
    key_center: Tensor | None = None


class DequantizeArgs(NamedTuple):
    """``tq.dequantize``: dense K and V of every sequence."""

    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    block_table: Tensor
    seq_lens: Tensor
    rotation: Tensor
    fmt: str
    max_seq_len: int
    dtype: torch.dtype
    k_window: Tensor | None = None
    v_window: Tensor | None = None
    window_pos: Tensor | None = None
    sinks: int = 0
    key_center: Tensor | None = None


class DecodeArgs(NamedTuple):
    """``tq.decode``: attention of one query token per sequence over its cache."""

    q: Tensor
    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    block_table: Tensor
    seq_lens: Tensor
    rotation: Tensor
    fmt: str
    num_splits: int
    scale: float
    mask: Tensor | None = None
    k_window: Tensor | None = None
    v_window: Tensor | None = None
    window_pos: Tensor | None = None
    sinks: int = 0
    softcap: float = 0.0


class DecodeStepArgs(NamedTuple):
    """``tq.decode_step``: one new token per sequence attends its cache as it was and itself
    exactly, then is appended to the cache and its recent window."""

    q: Tensor
    key: Tensor
    value: Tensor
    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    block_table: Tensor
    start_pos: Tensor
    rotation: Tensor
    fmt: str
    num_splits: int
    scale: float
    k_window: Tensor
    v_window: Tensor
    window_pos: Tensor
    sinks: int = 0
    mask: Tensor | None = None
    softcap: float = 0.0


class PrefillArgs(NamedTuple):
    """``tq.prefill``: attention of a chunk of new tokens over their own exact keys and values
    and their sequences' compressed prefix."""

    q: Tensor
    key: Tensor
    value: Tensor
    k_codes: Tensor
    v_codes: Tensor
    meta: Tensor
    block_table: Tensor
    seq_lens: Tensor
    rotation: Tensor
    fmt: str
    scale: float
    is_causal: bool
    max_seq_len: int
    mask: Tensor | None = None
    k_window: Tensor | None = None
    v_window: Tensor | None = None
    window_pos: Tensor | None = None
    sinks: int = 0
    key_center: Tensor | None = None
    softcap: float = 0.0


def window_fields(window: RecentWindow | None, args: type[NamedTuple]) -> dict:
    """``window`` as keyword arguments of the op argument tuple ``args`` (the flat form its
    schema takes; the inverse of :func:`window_of`).

    Args:
        window: the recent window, or None.
        args: the op's argument ``NamedTuple`` type.

    Returns:
        ``{field: value}`` for each field of ``window`` that ``args`` has (``tq.decode``'s
        has no ``key_center``: the decode reads the keys as stored); ``{}`` for None, which
        leaves the fields at their defaults (no rings).
    """
    if window is None:
        return {}
    # the names are a prefix of the window's fields
    return dict(zip(_window_names(args), window, strict=False))


def window_of(args: NamedTuple) -> RecentWindow | None:
    """The recent window that op arguments ``args`` carry flat (:func:`window_fields`), or None
    without rings (``args.k_window`` None); a field ``args`` lacks takes its default."""
    if args.k_window is None:
        return None
    return RecentWindow(*_window_getter(type(args))(args))


# Both run on every eager op call: what they read of an argument type is worked out once.
@functools.cache
def _window_names(args: type[NamedTuple]) -> tuple[str, ...]:
    """The fields of :class:`RecentWindow` that op argument type ``args`` has: a prefix of them
    (``tq.decode`` stops before ``key_center``)."""
    names = tuple(name for name in RecentWindow._fields if name in args._fields)
    if names != RecentWindow._fields[: len(names)]:
        raise TypeError(f"{args.__name__} must take a prefix of {RecentWindow._fields}")
    return names


@functools.cache
def _window_getter(args: type[NamedTuple]) -> operator.attrgetter:
    """Reads :func:`_window_names`' fields off an ``args`` tuple, as a tuple."""
    return operator.attrgetter(*_window_names(args))


# Python annotation -> schema type (this module keeps its annotations evaluated for this).
_SCHEMA_TYPES = {
    Tensor: "Tensor",
    Tensor | None: "Tensor?",
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    torch.dtype: "ScalarType",
}


def op_schema(
    name: str, args: type[NamedTuple], mutates: tuple[str, ...] = (), returns: str = "()"
) -> str:
    """The ``torch.library`` schema of operator ``name`` taking ``args``' fields in order.

    Args:
        name: operator name without the namespace (``"decode"``).
        args: the operator's argument ``NamedTuple``.
        mutates: fields the operator writes in place (each gets its own alias set, ``(a!)``).
        returns: the schema's return type (``"()"``, ``"Tensor"``, ``"(Tensor, Tensor)"``).
    """
    unknown = set(mutates) - set(args._fields)
    if unknown:
        raise ValueError(f"{name}: mutated arguments {sorted(unknown)} are not fields of {args}")
    parts = []
    for field in args._fields:
        schema_type = _SCHEMA_TYPES[args.__annotations__[field]]
        if field in mutates:  # an optional one stays optional: Tensor(a!)?
            alias = f"Tensor({chr(ord('a') + mutates.index(field))}!)"
            schema_type = schema_type.replace("Tensor", alias, 1)
        default = args._field_defaults.get(field, ...)
        suffix = "" if default is ... else f"={'None' if default is None else default}"
        parts.append(f"{schema_type} {field}{suffix}")
    return f"{name}({', '.join(parts)}) -> {returns}"
