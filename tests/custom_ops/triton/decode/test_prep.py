"""The query preparation kernel (``custom_ops/triton/decode/prep.py``): each block shape the
plan picks by the rows writes every query row rotated and scaled into its parts, the padded
columns zero."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import clone_cache, decode_case, longer_table

from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode import QueryMode
from custom_ops.triton.decode.prep import launch_prep, prep_blocks


def _expected_q_code(q, rotation, parts, pc, pc_pad, q_scale):
    """float64 ``(q @ R / sqrt(D)) * q_scale`` as ``[rows, parts * pc_pad]``, part ``p``'s
    elements ``p * pc + j`` in columns ``p * pc_pad + j``, the rest zero."""
    rows = q.reshape(-1, q.shape[-1]).double()
    rotated = rows @ rotation.double() / math.sqrt(q.shape[-1]) * q_scale
    expected = torch.zeros(rows.shape[0], parts, pc_pad, dtype=torch.float64)
    expected[:, :, :pc] = rotated.reshape(-1, parts, pc)
    return expected.reshape(rows.shape[0], -1)


@pytest.mark.parametrize(("fmt_name", "head_dim"), [("4bit_nc", 80), ("3bit_nc", 96)])
@pytest.mark.parametrize(("batch", "blocks"), [(3, (16, 16)), (75, (32, 32)), (275, (32, 64))])
def test_prepared_query_of_each_block_shape(
    fmt_name, head_dim, batch, blocks, kernel_device, seeded
):
    """Batches of 12, 300 and 1,100 query rows (4 per sequence) take each of
    :func:`prep_blocks`' three shapes, with rows left over in the last block, at head dims
    whose parts are padded (4bit_nc at 80: two parts of 40 in 64 columns; 3bit_nc at 96: four
    of 24 in 32); the output starts as NaN, so a row or column no program writes fails too."""
    fmt, consts, cache, table, _, _ = decode_case(fmt_name, head_dim, 2, seeded)
    q = torch.randn(batch, 4, head_dim, generator=seeded).to(torch.bfloat16)
    table = longer_table(table)[torch.arange(batch) % table.shape[0]]
    plan = triton_decode.plan_for(
        fmt, q.to(kernel_device), clone_cache(cache, kernel_device), table, 2
    )
    assert plan.query == QueryMode.PREPARED
    keys = plan.keys
    columns = keys.PARTS * keys.PC_PAD
    assert prep_blocks(batch * 4) == blocks
    block_q, block_c = blocks
    assert plan.prep.grid == (-(-batch * 4 // block_q), columns // block_c)
    q_scale = 0.7
    q_code = torch.full((batch * 4, columns), math.nan, dtype=torch.float16, device=kernel_device)
    rotation = consts.rotation.to(kernel_device)
    launch_prep(plan.prep, q.to(kernel_device), rotation, q_code, q_scale)
    expected = _expected_q_code(q, consts.rotation, keys.PARTS, keys.PC, keys.PC_PAD, q_scale)
    # fp16 rounding of a float32 product of exact terms: half an fp16 ulp and float32's sums
    torch.testing.assert_close(q_code.cpu().double(), expected, rtol=2**-10, atol=1e-5)
