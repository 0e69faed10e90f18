"""The decode split count: one policy for the cache, :mod:`custom_ops.api`, validation and the
kernels.

Decode splits each sequence's positions over a *fixed* number of programs per (sequence,
kv-head). The count is chosen once per cache from its capacity and the GPU's SM count, never
from the current lengths, so a captured CUDA graph stays valid as sequences grow.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_SPLITS", "is_valid_num_splits", "choose_num_splits", "num_splits_for"]

MAX_SPLITS = 512
# Programs of the split kernel per SM that the count aims at, and the fewest tokens worth a
# split of its own.
PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 32


def is_valid_num_splits(num_splits: int) -> bool:
    """Whether ``num_splits`` is a power of two in ``[1, MAX_SPLITS]`` (the merge and the
    split kernel's constexprs assume both)."""
    return 1 <= num_splits <= MAX_SPLITS and num_splits & (num_splits - 1) == 0


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def choose_num_splits(batch: int, num_kv_heads: int, capacity: int, sm_count: int) -> int:
    """About :data:`PROGRAMS_PER_SM` programs per SM, at least :data:`MIN_SPLIT_TOKENS`
    positions per split, rounded up to a power of two and at most :data:`MAX_SPLITS`.

    Args:
        batch: sequences the cache holds.
        num_kv_heads: Hk.
        capacity: positions one sequence can hold (``max_pages * page_size + window``).
        sm_count: the GPU's streaming multiprocessors.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    by_length = max(1, capacity // MIN_SPLIT_TOKENS)
    return min(MAX_SPLITS, _next_power_of_2(max(1, min(wanted, by_length))))


def num_splits_for(
    batch: int, num_kv_heads: int, capacity: int, device: torch.device | str
) -> int:
    """:func:`choose_num_splits` on ``device``'s GPU; 1 off CUDA (the reference has no splits)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(batch, num_kv_heads, capacity, sm_count)
