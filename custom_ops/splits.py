"""The decode split count: one policy for the cache, :mod:`custom_ops.api`, validation and the
kernels.

Decode splits each sequence's positions over a *fixed* number of programs per (sequence,
kv-head). The count is chosen once per cache from its capacity and the GPU's SM count, never
from the current lengths, so a captured CUDA graph stays valid as sequences grow; launches of
many query rows per program take at most as many as are resident at once
(:func:`splits_in_one_wave`), which depends on the step's shape only.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_SPLITS",
    "LONG_SPLIT_TOKENS",
    "MANY_PROGRAMS_PER_SM",
    "is_valid_num_splits",
    "choose_num_splits",
    "num_splits_for",
    "splits_in_one_wave",
    "resident_programs",
    "many_long_splits",
]

MAX_SPLITS = 512
# Programs of the split kernel per SM that the count aims at, and the fewest tokens worth a
# split of its own.
PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 32
# Large batches at long contexts: the count also aims at MANY_PROGRAMS_PER_SM programs per SM
# (at least two waves of the 16 that fit; fewer than 64 after rounding up to a power of two)
# where each split keeps at least LONG_SPLIT_TOKENS positions. One program per sequence-head
# fills few of an SM's slots (B 163 x 8k, Hk 8: 1304 programs for 2112 slots, 4bit_nc's kernel
# at 53% of copy bandwidth on an H200); four splits of 2,080 positions take it to 78%. The floor
# keeps shorter contexts at the counts measured best there (16 x 8192: 16 splits of 512
# positions at 64% of copy bandwidth, 32 of 256 at 54%); it is not a measured crossover
# (docs/design/decode.md#the-launch-plan).
MANY_PROGRAMS_PER_SM = 32
LONG_SPLIT_TOKENS = 2048
# Registers of one SM (every CUDA GPU since compute capability 5.0): 4 sub-partitions of 16384
# 32-bit registers, each warp's taken from one sub-partition in units of 256
# (cudaOccMaxBlocksPerSMRegsLimit in CUDA's cuda_occupancy.h).
SUB_PARTITIONS = 4
REGISTERS_PER_SUB_PARTITION = 16384
WARP_REGISTER_UNIT = 256


def is_valid_num_splits(num_splits: int) -> bool:
    """Whether ``num_splits`` is a power of two in ``[1, MAX_SPLITS]`` (the merge and the
    split kernel's constexprs assume both)."""
    return 1 <= num_splits <= MAX_SPLITS and num_splits & (num_splits - 1) == 0


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _power_of_2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def choose_num_splits(batch: int, num_kv_heads: int, capacity: int, sm_count: int) -> int:
    """The larger of two counts, at most :data:`MAX_SPLITS`: about :data:`PROGRAMS_PER_SM`
    programs per SM of at least :data:`MIN_SPLIT_TOKENS` positions, rounded up to a power of
    two; and at least :data:`MANY_PROGRAMS_PER_SM` programs per SM (rounded up to a power of
    two) but no split shorter than :data:`LONG_SPLIT_TOKENS` positions (large batches at long
    contexts).

    Args:
        batch: sequences the cache holds.
        num_kv_heads: Hk.
        capacity: positions one sequence can hold (``max_pages * page_size + window``).
        sm_count: the GPU's streaming multiprocessors.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    few = _next_power_of_2(max(1, min(wanted, capacity // MIN_SPLIT_TOKENS)))
    many = min(
        _next_power_of_2(-(-MANY_PROGRAMS_PER_SM * sm_count // programs)),
        _power_of_2_at_most(max(1, capacity // LONG_SPLIT_TOKENS)),
    )
    return min(MAX_SPLITS, max(few, many))


def num_splits_for(
    batch: int, num_kv_heads: int, capacity: int, device: torch.device | str
) -> int:
    """:func:`choose_num_splits` on ``device``'s GPU; 1 off CUDA (the reference has no splits)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(batch, num_kv_heads, capacity, sm_count)


def splits_in_one_wave(
    num_splits: int, programs_per_split: int, num_warps: int, max_registers: int, sm_count: int
) -> int:
    """The split count of a launch whose programs hold many registers: ``num_splits``, or the
    largest power of two below it whose grid is resident on the GPU at once (at least 1).

    The count a cache chooses (:func:`choose_num_splits`) is sized for the one-token kernel (a
    warp of 128 registers, 16 programs per SM); a verify step's 16 or 32 query rows take 192
    or 255 registers, so 8 of its programs fit an SM, and that grid would run in two waves. One
    wave of longer splits also writes fewer partials (``rows x D`` float32 per program: 16 KB
    at 32 rows, 33.5 MB over the 2048 programs of 1 x 32768, as much as the 4-bit cache's 35.1
    MB): ``docs/design/decode.md#one-wave-of-splits``.

    Args:
        num_splits: the cache's split count (a power of two).
        programs_per_split: programs per split in the grid (``B * Hk``).
        num_warps, max_registers: each program's warps and register cap per thread.
        sm_count: the GPU's streaming multiprocessors.
    """
    resident = resident_programs(num_warps, max_registers, sm_count)
    fitting = max(1, resident // max(1, programs_per_split))
    return min(num_splits, 1 << (fitting.bit_length() - 1))


def many_long_splits(
    num_splits: int, programs_per_split: int, capacity: int, sm_count: int
) -> bool:
    """Whether a launch's splits are long and fill several waves, as the large batches' do
    (:func:`choose_num_splits`' second count): at least :data:`LONG_SPLIT_TOKENS` positions
    each, and at least :data:`MANY_PROGRAMS_PER_SM` programs per SM (two waves of the 16
    one-warp programs that fit).

    Args:
        num_splits: the launch's split count.
        programs_per_split: programs per split in the grid (``B * Hk``).
        capacity: the positions the splits divide among them (the split kernel's: the paged
            positions, without a recent window's).
        sm_count: the GPU's streaming multiprocessors.

    Returns:
        Whether both hold.
    """
    long_splits = capacity >= num_splits * LONG_SPLIT_TOKENS
    return long_splits and num_splits * programs_per_split >= MANY_PROGRAMS_PER_SM * sm_count


def resident_programs(num_warps: int, max_registers: int, sm_count: int) -> int:
    """How many programs of ``num_warps`` warps at ``max_registers`` registers per thread the
    GPU holds at once, by registers (at least one per SM).

    Args:
        num_warps, max_registers: each program's warps and register cap per thread.
        sm_count: the GPU's streaming multiprocessors.
    """
    warp_registers = -(-32 * max_registers // WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT
    warps_per_sm = REGISTERS_PER_SUB_PARTITION // warp_registers * SUB_PARTITIONS
    return max(1, warps_per_sm // num_warps) * sm_count
