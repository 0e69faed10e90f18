"""custom_ops/validate.py: checks of metadata are remembered, never skipped."""

from __future__ import annotations

import pytest
from helpers import decode_case

from custom_ops import api


@pytest.mark.gpu
def test_remembered_checks_still_reject_other_metadata(seeded):
    """On CUDA (no value checks) a decode's metadata checks run once per metadata: after good
    calls, inputs that differ in dtype, shape or contiguity still raise the op's errors."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    cache = type(cache)(*(p.cuda() for p in cache))
    args = (cache, table.cuda(), lens.cuda(), api.KVConstants(consts.rotation.cuda()))
    for _ in range(3):
        api.decode(fmt, q.cuda(), *args, num_splits=2)
    bad = {
        "float32 query": (q.cuda().float(), TypeError, "q must be bfloat16 or float16"),
        "heads not a multiple": (q.cuda()[:, :7], ValueError, "not a multiple"),
        "batch mismatch": (q.cuda()[:2], ValueError, "rows for a batch of 2"),
    }
    for bad_q, error, message in bad.values():
        with pytest.raises(error, match=message):
            api.decode(fmt, bad_q, *args, num_splits=2)
    bad_rotation = api.KVConstants(consts.rotation.cuda().t())  # not contiguous
    with pytest.raises(ValueError, match="rotation must be a contiguous"):
        api.decode(fmt, q.cuda(), *args[:3], bad_rotation, num_splits=2)
