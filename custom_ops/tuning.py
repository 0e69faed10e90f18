"""Per-format tuning of the decode kernel: the one table that names presets for speed.

Kernels never test a preset's name; the launch plan (:mod:`custom_ops.triton.decode.plan`) reads
this table and turns it into compile-time parameters. The numbers behind each entry (H100
sweeps, offline SASS): ``docs/design/decode.md#ring-tiles-and-16-token-tiles``.
"""

from __future__ import annotations

from dataclasses import dataclass

from custom_ops.formats import FORMATS, KVFormat

__all__ = ["DecodeTuning", "DECODE_TUNING", "decode_tuning"]


@dataclass(frozen=True)
class DecodeTuning:
    """How the split kernel streams one format.

    Attributes:
        subtiles_short: tiles per softmax step where every split holds at most one step of
            tokens (short contexts): 1 (one 32-token tile) or 2 (two 16-token tiles).
        subtiles_long: the same for longer splits. Two independent 16-token tiles keep more
            loads in flight, which pays where the kernel waits on memory and the format's
            registers allow it (``docs/design/decode.md``: tiles, ring tiles).
        scalars_ahead: streaming splits of one tile per step and few query rows (not verify
            steps or wide GQA groups) load each tile's key and value scalars during the tile
            before (``docs/design/decode.md``: tiles), which pays where the registers they
            hold across a tile do not spill.
        value_pages: tiles of two pages read each page's value codes as a tile of their own
            (``docs/design/decode.md``: tiles), where the plan's conditions allow it.
    """

    subtiles_short: int = 1
    subtiles_long: int = 1
    scalars_ahead: bool = False
    value_pages: bool = True


DECODE_TUNING: dict[str, DecodeTuning] = {
    "k8v4": DecodeTuning(subtiles_long=2),
    "4bit_nc": DecodeTuning(scalars_ahead=True),
    "k3v4_nc": DecodeTuning(subtiles_long=2),
    "3bit_nc": DecodeTuning(),
    "int8": DecodeTuning(subtiles_short=2, subtiles_long=2),
    "fp8": DecodeTuning(subtiles_short=2, subtiles_long=2),
    "tq4_nc": DecodeTuning(),
    "tq3_nc": DecodeTuning(),
    # value pages against two-page value tiles, H200, 1 x 131072 / 16 x 8192 / 1 x 4096:
    # 0.99x / 0.96x / 0.93x (not understood: tqk4v2_nc's 2-bit values gained 1.03x / 1.02x /
    # 1.01x, k2v2_nc's 1.00x / 1.00x / 1.06x)
    "tq2_nc": DecodeTuning(value_pages=False),
    "tqk4v2_nc": DecodeTuning(scalars_ahead=True),
    # one 32-token tile: two 16-token tiles spill (2623 SASS instructions per 32 tokens, 172
    # STL; one: 1440); H200 1 x 131072: 109 us, two 32-token tiles on two warps 114 (both
    # measured at 1510 and 2684 instructions, before the signs went into the high bytes)
    "tqk5v3_nc": DecodeTuning(),
    "k2v2_nc": DecodeTuning(),
    "k2v4_nc": DecodeTuning(subtiles_long=2),
}
assert DECODE_TUNING.keys() == FORMATS.keys(), "every format needs a tuning entry"


def decode_tuning(fmt: KVFormat) -> DecodeTuning:
    """The tuning of ``fmt`` (defaults for a format built outside :data:`FORMATS`)."""
    return DECODE_TUNING.get(fmt.name, DecodeTuning())
