"""The split-count policy (``custom_ops/splits.py``)."""

from __future__ import annotations

import pytest

from custom_ops.splits import splits_in_one_wave


@pytest.mark.parametrize(
    "num_splits, programs_per_split, num_warps, max_registers, expected",
    [
        (256, 8, 1, 255, 128),  # T = 8 at 1 x 32768: 8 programs of 255 registers per SM
        (16, 128, 1, 255, 8),  # T = 8 at 16 x 8192
        (256, 8, 1, 192, 128),  # T = 4: 10 per SM
        (16, 128, 1, 192, 8),
        (256, 8, 1, 128, 256),  # the one-token kernel's grid is resident already
        (4, 6, 1, 255, 4),  # a small grid keeps the cache's count
        (512, 100_000, 8, 255, 1),  # more programs than ever fit: one split
    ],
)
def test_splits_in_one_wave(num_splits, programs_per_split, num_warps, max_registers, expected):
    """On 132 SMs (an H100): the largest power of two up to the cache's count whose grid is
    resident at once, at 8 registers' granularity (255 takes 256)."""
    splits = splits_in_one_wave(num_splits, programs_per_split, num_warps, max_registers, 132)
    assert splits == expected
    per_sm = 65536 // (32 * num_warps * -(-max_registers // 8) * 8)
    assert splits == 1 or splits * programs_per_split <= per_sm * 132
    assert splits == num_splits or 2 * splits * programs_per_split > per_sm * 132
