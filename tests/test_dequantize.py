"""tq.dequantize: the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_kernels
from helpers import clone_cache, filled_cache

from custom_ops import api, reference
from custom_ops.formats import FORMATS, SUPPORTED_HEAD_DIMS, get_format


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_kernel_matches_reference(fmt_name, head_dim, kernel_device, seeded):
    """Dequantizing a filled, paged cache with ragged lengths (0, 1, full) and a shuffled block
    table gives the reference's K and V (float32: up to a rotation's summation order); every
    output element is written, zeros past each length."""
    fmt = get_format(fmt_name)
    num_pages, num_kv_heads, page_size, max_seq_len = 10, 2, 4, 14
    consts = api.make_constants(fmt, head_dim, seed=5)
    cache = filled_cache(fmt, num_pages, num_kv_heads, page_size, head_dim, consts, seeded)
    block_table = torch.randperm(num_pages, generator=seeded).to(torch.int32).reshape(5, 2)
    block_table = block_table.repeat(1, 2)[:4].T  # [4, 4]: rows share pages, transposed strides
    assert block_table.stride(1) != 1
    seq_lens = torch.tensor([14, 0, 1, 9], dtype=torch.int32)
    expected = reference.dequantize(
        fmt, cache, block_table, seq_lens, *consts, max_seq_len, torch.float32
    )
    dev = api.KVConstants(*(c.to(kernel_device) for c in consts))
    with triton_kernels(kernel_device):
        actual = api.dequantize(
            fmt,
            clone_cache(cache, kernel_device),
            block_table.to(kernel_device),
            seq_lens.to(kernel_device),
            dev,
            max_seq_len,
            torch.float32,
        )
    for exp, act in zip(expected, actual, strict=True):
        assert act.shape == (4, num_kv_heads, max_seq_len, head_dim)
        torch.testing.assert_close(act.cpu(), exp, rtol=1e-5, atol=1e-5)
        assert bool((act[1] == 0).all()) and bool((act[2, :, 1:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype(dtype, kernel_device, seeded):
    """Any float output dtype: the float32 result rounded once to that dtype."""
    fmt = get_format("4bit_nc")
    consts = api.make_constants(fmt, 64)
    cache = filled_cache(fmt, 4, 1, 8, 64, consts, seeded)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    exp = reference.dequantize(fmt, cache, table, lens, *consts, 24, torch.float32)
    dev = api.KVConstants(*(c.to(kernel_device) for c in consts))
    with triton_kernels(kernel_device):
        act = api.dequantize(
            fmt,
            clone_cache(cache, kernel_device),
            table.to(kernel_device),
            lens.to(kernel_device),
            dev,
            24,
            dtype,
        )
    assert act[0].dtype == dtype
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float64: 1e-5}[dtype]
    torch.testing.assert_close(act[0].cpu(), exp[0].to(dtype), rtol=tol, atol=tol)
