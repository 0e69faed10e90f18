"""custom_ops/validate.py: checks of metadata are remembered, never skipped."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_case

from custom_ops import api, validate


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


@pytest.mark.gpu
def test_remembered_launches_follow_device_and_alignment(seeded):
    """The launch key of a call covers every tensor's device and 16-byte alignment: after good
    calls, a rotation on another device still fails the device check, and a query 2 bytes off
    alignment (a view into a larger buffer) gets a kernel specialized for it, with the same
    output as the aligned query."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    cache = type(cache)(*(p.cuda() for p in cache))
    args = (cache, table.cuda(), lens.cuda(), api.KVConstants(consts.rotation.cuda()))
    q = q.cuda()
    for _ in range(3):
        aligned = api.decode(fmt, q, *args, num_splits=2)
    with pytest.raises(ValueError, match="rotation is on cpu but the cache is on cuda"):
        api.decode(fmt, q, *args[:3], api.KVConstants(consts.rotation), num_splits=2)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 != 0
    torch.testing.assert_close(
        api.decode(fmt, shifted, *args, num_splits=2), aligned, rtol=0, atol=0
    )


def test_launch_key_only_for_plain_cuda_tensors():
    """Arguments whose checks read values (CPU) or that are not plain tensors get no key: their
    checks run on every call."""
    cpu = torch.zeros(4)
    assert validate.launch_key((cpu, 1, "4bit_nc")) is None
    assert validate.launch_key((torch.nn.Parameter(cpu), 1)) is None


@pytest.mark.gpu
def test_launch_keys_are_interned_and_fixed_metadata_is_what_a_read_gives():
    """Arguments of equal metadata get the very same key (hashed once, found by identity in
    every memo); a tensor declared fixed contributes what reading it gives (alignment
    included), and a fixed tensor's entry is never used for a later tensor at its id."""
    a, b = torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda")
    key = validate.launch_key((a, 1, "4bit_nc"))
    assert validate.launch_key((b, 1, "4bit_nc")) is key
    assert validate.launch_key((b, 2, "4bit_nc")) is not key
    shifted = torch.zeros(33, device="cuda")[1:].view(4, 8)
    unaligned = validate.launch_key((shifted, 1, "4bit_nc"))
    assert unaligned != key
    validate.fix_metadata(a, shifted)
    assert validate.launch_key((a, 1, "4bit_nc")) is key
    assert validate.launch_key((shifted, 1, "4bit_nc")) is unaligned
    for size in range(1, 40):  # freed fixed tensors: new ones may reuse their ids
        fixed = torch.zeros(size, device="cuda")
        validate.fix_metadata(fixed)
        del fixed
        fresh = torch.zeros(size + 1, 2, device="cuda")
        assert validate.launch_key((fresh,)).items[0] == (size + 1, 2)
