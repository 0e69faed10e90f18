"""``CacheOptions``: the format and options of a TurboQuant cache, declared and checked once.

Every cache takes the same seven options: the gpt-fast module
(:class:`~tq_compile.cache.TurboQuantKVCache`), the Hugging Face layer and cache
(:mod:`tq_compile.hf`) and the ``quantize_`` config
(:class:`~tq_compile.config.TurboQuantKVConfig`).
Each accepts them as keywords or as one ``options=CacheOptions(...)``, builds one frozen
:class:`CacheOptions` (which checks them all, naming the argument, before anything is built) and
passes it whole to what it builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from custom_ops import splits
from custom_ops.formats import get_format

__all__ = [
    "CacheOptions",
    "DEFAULT_SINKS",
    "default_sinks",
    "check_count",
]

# Attention sinks a cache with a recent window keeps by default: on SmolLM2 four first tokens
# in bf16 lower every low-bit format's perplexity cost (by 5-30% for most; int8's moves within
# noise), for no measurable step time (docs/design/cache.md#attention-sinks).
DEFAULT_SINKS = 4


def default_sinks(window: int, sinks: int | None) -> int:
    """``sinks``, or where it is None the default of a cache with this ``window``:
    :data:`DEFAULT_SINKS` with a window, 0 without (``window=0`` quantizes every token).
    Values that are not counts pass through to the caller's checks."""
    if sinks is not None:
        return sinks
    return DEFAULT_SINKS if isinstance(window, int) and window > 0 else 0


def check_count(name: str, value, least: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an integer (not a bool) of at
    least ``least``."""
    if type(value) is not int or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class CacheOptions:
    """The format and options of a TurboQuant cache.

    Args:
        preset: format name, one of ``custom_ops.FORMATS`` (vLLM's presets and ours: the table
            in ``docs/design/formats.md``).
        window: W, the most recent tokens of each sequence kept in the model's dtype in a ring
            and quantized only when they leave it (0: every token quantized when written).
        sinks: the first tokens of each sequence kept in the model's dtype for good (attention
            sinks; None: :data:`DEFAULT_SINKS` with a window, 0 without; :attr:`sink_count`).
        center_keys: store keys minus one centre per sequence and kv-head
            (``docs/design/cache.md#key-centering``); needs a window or sinks.
        page_size: tokens per page of the paged cache.
        seed: seed of the random-sign Hadamard rotation.
        num_splits: the decode kernel's split count (None: chosen per cache from its capacity
            and the GPU; else a power of two up to ``custom_ops.splits.MAX_SPLITS``).

    Raises:
        ValueError: an unknown preset, a count that is not an integer in range, a seed that is
            not an integer, a ``num_splits`` that is not a power of two in range,
            ``center_keys`` without a window or sinks.
        TypeError: ``center_keys`` not a bool.
    """

    preset: str = "4bit_nc"
    window: int = 128
    sinks: int | None = None
    center_keys: bool = False
    page_size: int = 16
    seed: int = 0
    num_splits: int | None = None

    def __post_init__(self) -> None:
        get_format(self.preset)
        check_count("page_size", self.page_size, 1)
        check_count("window", self.window, 0)
        check_count("sinks", self.sink_count, 0)
        if type(self.seed) is not int:
            raise ValueError(
                f"seed must be an integer (the rotation's random signs), got {self.seed!r}"
            )
        num_splits = self.num_splits
        if num_splits is not None and (
            type(num_splits) is not int or not splits.is_valid_num_splits(num_splits)
        ):
            raise ValueError(
                f"num_splits must be None (chosen per device) or a power of two in "
                f"[1, {splits.MAX_SPLITS}], got {self.num_splits!r}"
            )
        if type(self.center_keys) is not bool:
            raise TypeError(f"center_keys must be a bool, got {self.center_keys!r}")
        if self.center_keys and self.window == 0 and self.sink_count == 0:
            raise ValueError(
                "center_keys=True needs a window or sinks (window > 0 or sinks > 0): "
                "the centre is set from keys held in the ring before any is "
                "quantized"
            )

    @property
    def sink_count(self) -> int:
        """The sinks a cache keeps: ``sinks``, or its default for the window."""
        return default_sinks(self.window, self.sinks)

    def ring_for(self, capacity: int) -> tuple[int, int]:
        """``(window, sinks)`` that a cache of ``capacity`` tokens per sequence keeps: the
        window at most the capacity, and no more sinks than positions that can leave it.

        Sizing the ring down loses nothing: with ``W`` window slots a position leaves the window
        only when ``W`` later ones are written, so positions at or past ``capacity - W`` never
        do and need no sink slot. When the two cover the capacity (``window + sinks ==
        capacity``), no token is ever quantized.
        """
        window = min(self.window, capacity)
        return window, min(self.sink_count, capacity - window)

    def quantizes_nothing(self, capacity: int) -> bool:
        """Whether a cache of ``capacity`` tokens per sequence keeps every token in its ring
        (:meth:`ring_for` covers the capacity): none is ever quantized."""
        return sum(self.ring_for(capacity)) == capacity

    @classmethod
    def of(cls, options: CacheOptions | None, fields: dict) -> CacheOptions:
        """``options`` (default ``CacheOptions()``) with the keyword ``fields`` a constructor
        was given replacing its own.

        Raises:
            TypeError: a keyword that is no option (naming the options there are).
        """
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(names))
        if unknown:
            hint = " (the format is `preset`)" if "fmt" in unknown else ""
            raise TypeError(f"unknown cache option(s) {unknown}{hint}: the options are {names}")
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"options must be a CacheOptions, got {type(base).__name__}")
        return dataclasses.replace(base, **fields) if fields else base
