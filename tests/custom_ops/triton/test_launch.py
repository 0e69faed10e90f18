"""custom_ops/triton/launch.py: kernels launched through their compiled handles."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_cache, random_kv

from custom_ops import api, reference
from custom_ops.formats import get_format


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4"])
def test_each_specialization_gets_its_own_kernel(fmt_name, seeded):
    """A Launcher compiles once per specialization of its arguments and then launches the
    compiled handle: keys 16-byte aligned, then a view 2 bytes off (a kernel built for aligned
    pointers would read it wrongly or fault), then fp16 keys, each stored three times (the first
    store compiles, the others take the handle) into a fresh cache that must equal the
    reference's every time."""
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, 128, device="cuda")
    key, value = random_kv(33, 2, 128, torch.bfloat16, seeded)
    slots = torch.randperm(40, generator=seeded)[:32].to(torch.int32)
    inputs = {
        "aligned": (key[:32], value[:32]),
        "2 bytes off": (
            key.flatten()[1:].reshape(-1)[: 32 * 2 * 128].reshape(32, 2, 128),
            value.flatten()[1:][: 32 * 2 * 128].reshape(32, 2, 128),
        ),
        "fp16": (key[:32].half(), value[:32].half()),
    }
    for label, (k, v) in inputs.items():
        expected = fmt.allocate(10, 2, 4, 128)
        reference.store(fmt, k, v, expected, slots, consts.rotation.cpu())
        k_cuda, v_cuda = k.cuda(), v.cuda()
        if label == "2 bytes off":  # keep the offset on the device too
            k_cuda = key.cuda().flatten()[1:][: 32 * 2 * 128].reshape(32, 2, 128)
            v_cuda = value.cuda().flatten()[1:][: 32 * 2 * 128].reshape(32, 2, 128)
            assert k_cuda.data_ptr() % 16 == 2
        for _ in range(3):
            actual = fmt.allocate(10, 2, 4, 128, "cuda")
            api.store(fmt, actual, k_cuda, v_cuda, slots.cuda(), consts)
            torch.cuda.synchronize()
            assert_same_cache(fmt, expected, type(actual)(*(p.cpu() for p in actual)))
