"""The split kernel's int8 query (``int8_query``) against the int8 key string it pairs with."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from ptx_emulator import run

from custom_ops.codebook import int8_key_grid
from custom_ops.formats import SUPPORTED_HEAD_DIMS
from custom_ops.triton.decode.ptx import lut4_int8_asm
from custom_ops.triton.decode.query import int8_query

GROUP = 4  # query rows of a program (G_PAD)
TOKENS = 8


@triton.jit
def _int8_query_kernel(
    q_ptr,
    terms_ptr,
    half_sum_ptr,
    step_ptr,
    G: tl.constexpr,
    PC: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``q [G, 2, PC]`` (the halves, padded) -> ``terms [4, PC, G]`` (hi0, hi1, lo0, lo1),
    ``half_sum [G]``, ``step [G]``."""
    g = tl.arange(0, G)
    c = tl.arange(0, PC)
    rows = q_ptr + g[:, None] * 2 * PC + c[None, :]
    hi0, hi1, lo0, lo1, half_sum, step = int8_query(tl.load(rows), tl.load(rows + PC), INTERLEAVED)
    out = terms_ptr + c[:, None] * G + g[None, :]
    tl.store(out, hi0)
    tl.store(out + PC * G, hi1)
    tl.store(out + 2 * PC * G, lo0)
    tl.store(out + 3 * PC * G, lo1)
    tl.store(half_sum_ptr + g, half_sum)
    tl.store(step_ptr + g, step)


def _int8_query(q: torch.Tensor, interleaved: bool):
    """Run ``int8_query`` on ``q [G, 2, PC_PAD]`` fp16 where the kernels run."""
    group, _, pc_pad = q.shape
    terms = torch.empty(4, pc_pad, group, dtype=torch.int8, device=q.device)
    half_sum = torch.empty(group, dtype=torch.float32, device=q.device)
    step = torch.empty_like(half_sum)
    _int8_query_kernel[(1,)](q, terms, half_sum, step, group, pc_pad, interleaved)
    return terms.cpu(), half_sum.cpu(), step.cpu()


def _ptx_keys(codes: torch.Tensor, grid) -> torch.Tensor:
    """The inline PTX's int8 key operands of code bytes ``[N, PC_PAD]``: ``[2, N, PC_PAD]``, each
    4-byte group decoded by the emulator as the kernel's ``pack=4`` asm decodes it."""
    asm = lut4_int8_asm(grid)
    out = torch.empty(2, *codes.shape, dtype=torch.int8)
    words = codes.to(torch.int64).reshape(codes.shape[0], -1, 4)
    for n in range(words.shape[0]):
        for w in range(words.shape[1]):
            word = sum(int(b) << (8 * i) for i, b in enumerate(words[n, w]))
            regs = run(asm, {2: word})
            for half in range(2):
                lanes = [(regs[half] >> (8 * i)) & 0xFF for i in range(4)]
                out[half, n, 4 * w : 4 * w + 4] = torch.tensor(lanes, dtype=torch.uint8).view(
                    torch.int8
                )
    return out


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_interleaved_keys_and_query_give_the_plain_products(head_dim, kernel_device, seeded):
    """Against the PTX's interleaved int8 keys (each byte's low and high nibble side by side),
    the permuted query gives the plain order's integer products, hi and lo terms alike, with the
    same ``half_sum`` and ``step``; padded columns (D 80, 96: halves of 40 and 48 in 64) stay
    zero. The plain query is each row to within ``step / 508``."""
    half = head_dim // 2
    pc_pad = triton.next_power_of_2(half)
    q = torch.zeros(GROUP, 2, pc_pad, dtype=torch.float16)
    q[:, :, :half] = torch.randn(GROUP, 2, half, generator=seeded).to(torch.float16) * 3
    plain, plain_half_sum, plain_step = _int8_query(q.to(kernel_device), False)
    mixed, mixed_half_sum, mixed_step = _int8_query(q.to(kernel_device), True)
    assert torch.equal(mixed_half_sum, plain_half_sum) and torch.equal(mixed_step, plain_step)
    assert not plain[:, half:].any() and not mixed[:, half:].any()
    kept = (254 * plain[:2].double() + plain[2:].double()) * (plain_step.double() / 254)
    error = (kept - q.permute(1, 2, 0).double()).abs()
    assert bool((error <= plain_step.double() / 508 * (1 + 1e-9)).all())

    grid, _ = int8_key_grid(head_dim)
    codes = torch.zeros(TOKENS, pc_pad, dtype=torch.uint8)  # masked-off bytes load as 0
    codes[:, :half] = torch.randint(0, 256, (TOKENS, half), generator=seeded, dtype=torch.uint8)
    table = torch.tensor(grid, dtype=torch.int64)
    nibbles = torch.stack([codes & 15, codes >> 4]).to(torch.int64)  # [2, N, PC_PAD]
    magnitude = table[nibbles & 7]
    plain_keys = torch.where(nibbles >= 8, -magnitude - 1, magnitude)
    ptx_keys = _ptx_keys(codes, grid).to(torch.int64)
    for term in (0, 2):  # hi, then lo
        expected = plain_keys[0] @ plain[term].long() + plain_keys[1] @ plain[term + 1].long()
        actual = ptx_keys[0] @ mixed[term].long() + ptx_keys[1] @ mixed[term + 1].long()
        assert torch.equal(actual, expected)
