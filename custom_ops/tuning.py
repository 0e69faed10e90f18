"""Per-format tuning of the decode kernel: the one table that names presets for speed.

Kernels never test a preset's name; the launch plan (:mod:`custom_ops.triton.decode.plan`) reads
this table and turns it into compile-time parameters. Every format streams one 32-token tile
per softmax step (``docs/design/decode.md#ring-tiles-and-16-token-tiles``); the numbers behind
each entry (H100 and H200 timings, offline SASS): ``docs/design/decode.md``, tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from custom_ops.formats import FORMATS, KVFormat

__all__ = ["DecodeTuning", "DECODE_TUNING", "decode_tuning"]


@dataclass(frozen=True)
class DecodeTuning:
    """How the split kernel streams one format.

    Attributes:
        scalars_ahead: streaming splits of one tile per step and few query rows (not verify
            steps or wide GQA groups) load each tile's key and value scalars during the tile
            before (``docs/design/decode.md``: tiles), which pays where the registers they
            hold across a tile do not spill.
        value_pages: tiles of two pages read each page's value codes as a tile of their own
            (``docs/design/decode.md``: tiles), where the plan's conditions allow it.
        stages: software pipeline stages of streaming splits of few query rows (splits of
            one tile, verify steps of 4 or more tokens and wide GQA groups keep the plan's
            default of 2). At 3 Triton's pipeliner reads the block-table entries a tile ahead
            of the codes they address (the codes keep one buffer), which shortens each tile's
            chain of dependent loads for more loop instructions (4bit_nc 670 -> 701 per tile
            offline). Timed at page size 16, where each tile's page ids are scalars.
        long_split_stages: the stages of those splits where they are long and fill several
            waves, as the large batches' do (:func:`custom_ops.splits.many_long_splits`), on
            Hopper; 0 keeps ``stages``. At 5 Triton gives each code plane two shared-memory
            buffers, so a tile's copy starts a whole tile earlier than with one, where it
            waits for the tile before to read the buffer. The longer prologue (four tiles
            ahead) and the shared memory (tqk5v3_nc's two buffers: 12.6 KB since its keys read
            one sign tile, 14.6 KB before, when 14 programs fit an SM, not 16) cost more than
            that at shorter splits (``docs/notes/2026-12-03-loop-head-wait.md``).
    """

    scalars_ahead: bool = True
    value_pages: bool = True
    stages: int = 2
    long_split_stages: int = 0


# Three stages against two, H200, one run side by side (compare_decode.py), speed at 16 x 8192
# / 210 x 8192 / 1 x 131072: 4bit_nc 1.024 / 1.042 / 1.021, 3bit_nc 1.040 / 1.050 / 1.023,
# tq3_nc 1.049 / 1.034 / 1.007, tqk4v2_nc 1.024 / 1.040 / 1.009, tq4_nc 1.038 / 1.047 (165 x
# 8192) / 1.029. Three timed stay at two: k3v4_nc 1.001 / 1.013 / 0.986, k8v4 0.996 / 0.964
# / 1.021, and tqk5v3_nc, 0.994 / 1.019 (165 x 8192: 1.035) / 0.997 but 0.909 at 1 x 32768;
# int8, fp8, tq2_nc, k2v2_nc and k2v4_nc were not timed at three
# (docs/notes/2026-12-02-third-stage.md). Five stages in long splits of several waves against
# the row's stages, H200, two runs, 210 x 8192 / 165 x 8192 (2,048 positions per split), and 64
# x 32768 once: k3v4_nc 1.044-1.052 / 1.054-1.074 / 1.022, tqk5v3_nc 1.036-1.052 / 1.004-1.008 /
# 1.047, taken; tq4_nc 1.019-1.030 / 1.021-1.030 / 1.011, tq3_nc 1.013-1.024 / 1.015-1.019 /
# 1.021, 3bit_nc 1.008-1.025 / 1.004-1.020 / 1.005, within those runs' noise (unchanged kernels
# read up to 1.025), then taken on a third run of four rounds at windows 0 and 128, all 18
# cells 1.006-1.034 where the same tree against itself read 0.997-1.007
# (docs/notes/2026-12-03-sign-tiles-and-long-split-stages.md); 4bit_nc (1.019 / 1.017 / 0.989
# once) taken on four rounds at 163 x 8192 / 214 x 8192 / 64 x 32768, windows 0 and 128:
# 1.011-1.024. Not taken: tqk4v2_nc, 0.985-0.992 in the same run; tqk5v3_nc at five stages in
# every streaming split, 16 programs per SM since its keys' sign tile: 0.951 / 0.943 / 0.943 at
# 1 x 131072 / 4 x 32768 / 16 x 8192
# (docs/notes/2026-12-03-value-sign-tile-and-page-planar-keys.md)
DECODE_TUNING: dict[str, DecodeTuning] = {
    "k8v4": DecodeTuning(),
    "4bit_nc": DecodeTuning(stages=3, long_split_stages=5),
    "k3v4_nc": DecodeTuning(long_split_stages=5),
    "3bit_nc": DecodeTuning(stages=3, long_split_stages=5),
    "int8": DecodeTuning(),
    "fp8": DecodeTuning(),
    "tq4_nc": DecodeTuning(stages=3, long_split_stages=5),
    "tq3_nc": DecodeTuning(stages=3, long_split_stages=5),
    # value pages against two-page value tiles, H200, 1 x 131072 / 16 x 8192 / 1 x 4096:
    # 0.99x / 0.96x / 0.93x (not understood: tqk4v2_nc's 2-bit values gained 1.03x / 1.02x /
    # 1.01x, k2v2_nc's 1.00x / 1.00x / 1.06x); tq2_nc and k2v2_nc keep their scalars in their
    # own tile, the scalars ahead not timed for them (docs/design/decode.md: tiles)
    "tq2_nc": DecodeTuning(scalars_ahead=False, value_pages=False),
    "tqk4v2_nc": DecodeTuning(stages=3),
    "tqk5v3_nc": DecodeTuning(long_split_stages=5),
    "k2v2_nc": DecodeTuning(scalars_ahead=False),
    "k2v4_nc": DecodeTuning(),
}
assert DECODE_TUNING.keys() == FORMATS.keys(), "every format needs a tuning entry"


def decode_tuning(fmt: KVFormat) -> DecodeTuning:
    """The tuning of ``fmt`` (defaults for a format built outside :data:`FORMATS`)."""
    return DECODE_TUNING.get(fmt.name, DecodeTuning())
