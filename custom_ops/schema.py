"""The argument list of every ``torch.ops.tq`` operator, written once.

Each operator's arguments are a ``NamedTuple`` here: :mod:`custom_ops.ops` derives the
operator's schema from it (:func:`op_schema`), its real and fake implementations receive one,
:mod:`custom_ops.validate` checks one and :mod:`custom_ops.api` builds one. The docstrings of the
operators are in :mod:`custom_ops.ops`.
"""

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "StoreArgs",
    "StoreWindowArgs",
    "DequantizeArgs",
    "DecodeArgs",
    "PrefillArgs",
    "op_schema",
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
