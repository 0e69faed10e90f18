"""The split-count policy (``custom_ops/splits.py``)."""

from __future__ import annotations

import pytest

from custom_ops.splits import (
    choose_num_splits,
    many_long_splits,
    resident_programs,
    splits_in_one_wave,
)


@pytest.mark.parametrize(
    "num_splits, programs_per_split, num_warps, max_registers, expected",
    [
        # 255 registers: warps of 8192, 2 per sub-partition, 8 per SM; 1056 resident programs
        (256, 8, 1, 255, 128),  # T = 8 at 1 x 32768: 132 splits fit
        (16, 128, 1, 255, 8),  # T = 8 at 16 x 8192: 8.25 fit
        # 192 registers: warps of 6144, still 2 per sub-partition (8 per SM, not 65536 / 6144
        # = 10): 26 splits of 40 programs fit (33 at 10 per SM)
        (64, 40, 1, 192, 16),
        # 170 registers: warps of 5632 in units of 256 (5440 unrounded would fit 3 per
        # sub-partition): 8 per SM again
        (64, 40, 1, 170, 16),
        (64, 40, 2, 192, 8),  # two-warp programs: 4 per SM, 528 resident
        (256, 8, 1, 128, 256),  # the one-token kernel (16 per SM): its grid is resident already
        (4, 6, 1, 255, 4),  # a small grid keeps the cache's count
        (512, 100_000, 8, 255, 1),  # more programs than ever fit: one split
    ],
)
def test_splits_in_one_wave(num_splits, programs_per_split, num_warps, max_registers, expected):
    """On 132 SMs (an H100): the largest power of two up to the cache's count whose grid is
    resident at once, registers allocated per warp in units of 256 from one of the SM's four
    sub-partitions of 16384."""
    assert (
        splits_in_one_wave(num_splits, programs_per_split, num_warps, max_registers, 132)
        == expected
    )


@pytest.mark.parametrize(
    "num_warps, max_registers, expected",
    [(1, 128, 16 * 132), (2, 128, 8 * 132), (1, 255, 8 * 132), (1, 192, 8 * 132), (8, 255, 132)],
)
def test_resident_programs(num_warps, max_registers, expected):
    """Programs resident at once on 132 SMs, by registers (at least one per SM)."""
    assert resident_programs(num_warps, max_registers, 132) == expected


@pytest.mark.parametrize(
    "batch, capacity, expected",
    [
        # issue 50's decode table: 2,048 programs of 512 positions (32 of 256 measured slower)
        (1, 131072, 256),
        (4, 32768, 64),
        (16, 8192, 16),
        (64, 2048, 4),
        # one sequence and 16 at 4k and 32k with a 128-slot window; generate at B32 8k
        (1, 4224, 256),
        (1, 32896, 256),
        (16, 4224, 16),
        (16, 32896, 16),
        (32, 8320, 8),
        # the capacity batches at 24 GB and 8k: four splits of 2,080 positions, where 8 programs
        # per SM alone took one (B163: 1304 programs for 2112 slots) or two
        (112, 8320, 4),
        (163, 8320, 4),
        (214, 8320, 4),
        (112, 10368, 4),  # not 8 splits of 1,296: none shorter than 2,048 positions
        (64, 32896, 16),  # splits of 2,056 positions
        (2048, 8320, 1),  # more sequence-heads than two waves: one split
        (163, 4000, 1),  # splits would be shorter than 2,048 positions
        (1, 16, 1),  # at least 32 positions per split
        (1, 1 << 20, 512),  # 512 splits of 2,048 positions (the first count: 256)
        (1, 1 << 21, 512),  # at most MAX_SPLITS
    ],
)
def test_choose_num_splits(batch, capacity, expected):
    """The cache's split count on 132 SMs at Hk 8: about 8 programs per SM of at least 32
    positions, or at least 32 per SM where no split is shorter than 2,048 positions; a power
    of two at most 512."""
    assert choose_num_splits(batch, 8, capacity, 132) == expected


@pytest.mark.parametrize(
    "batch, capacity, expected",
    [
        (210, 8320, True),  # 3bit_nc's capacity batch at 24 GB: 6,720 programs of 2,080
        (165, 8192, True),  # 5,280 programs of 2,048 positions
        (64, 32768, True),  # 8,192 programs of 2,048
        (112, 8320, False),  # splits of 2,080 but 3,584 programs: under two waves
        (16, 8192, False),  # issue 50's decode table: splits of 512 positions
        (600, 1024, False),  # 4,800 programs, but one split of 1,024 positions
        (1, 1 << 20, False),  # 512 splits of 2,048 positions but 4,096 programs
        (4, 1 << 20, True),  # 256 splits of 4,096 positions, 8,192 programs
    ],
)
def test_many_long_splits(batch, capacity, expected):
    """Launches on 132 SMs at Hk 8 with the cache's split count: long splits of several waves
    are those of at least 2,048 positions and at least 32 programs per SM (4,224)."""
    num_splits = choose_num_splits(batch, 8, capacity, 132)
    assert many_long_splits(num_splits, batch * 8, capacity, 132) is expected
