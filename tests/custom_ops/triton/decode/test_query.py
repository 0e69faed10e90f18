"""The split kernel's int8 query (``int8_query``) against the int8 key strings it pairs with, and
the query rotated and rounded in the split kernel (``rotated_int8_query``) against the two steps
it fuses."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from ptx_emulator import run

from custom_ops import api
from custom_ops.codebook import int8_key_grid
from custom_ops.formats import SUPPORTED_HEAD_DIMS, get_format
from custom_ops.triton.decode.ptx import lut3_int8_asm, lut4_int8_asm, lut5_int8_asm
from custom_ops.triton.decode.query import (
    int8_query,
    rotate_query,
    rotated_int8_query,
    rotated_parts,
)

GROUP = 4  # query rows of a program (G_PAD)
TOKENS = 8
# the parts that one inline-PTX instance decodes together (its outputs $0, $1), per key bits
PAIRS = {3: ((0, 2), (1, 3)), 4: ((0, 1),), 5: ((0, 2), (1, 3))}


@triton.jit
def _int8_query_kernel(
    q_ptr,
    terms_ptr,
    half_sum_ptr,
    step_ptr,
    G: tl.constexpr,
    PC: tl.constexpr,
    PARTS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``q [G, PARTS, PC]`` (the parts, padded) -> ``terms [2, PARTS, PC, G]`` (hi, lo),
    ``half_sum [G]``, ``step [G]``."""
    g = tl.arange(0, G)
    c = tl.arange(0, PC)
    rows = q_ptr + g[:, None] * PARTS * PC + c[None, :]
    q0 = tl.load(rows)
    q1 = tl.load(rows + PC)
    q2 = q0
    q3 = q0
    if PARTS == 4:
        q2 = tl.load(rows + 2 * PC)
        q3 = tl.load(rows + 3 * PC)
    his, los, half_sum, step = int8_query(q0, q1, q2, q3, PARTS, INTERLEAVED)
    out = terms_ptr + c[:, None] * G + g[None, :]
    for part in tl.static_range(PARTS):
        tl.store(out + part * PC * G, his[part])
        tl.store(out + (PARTS + part) * PC * G, los[part])
    tl.store(half_sum_ptr + g, half_sum)
    tl.store(step_ptr + g, step)


def _int8_query(q: torch.Tensor, interleaved: bool):
    """Run ``int8_query`` on ``q [G, PARTS, PC_PAD]`` fp16 where the kernels run: ``terms [2,
    PARTS, PC_PAD, G]``, ``half_sum [G]``, ``step [G]``."""
    group, parts, pc_pad = q.shape
    terms = torch.empty(2, parts, pc_pad, group, dtype=torch.int8, device=q.device)
    half_sum = torch.empty(group, dtype=torch.float32, device=q.device)
    step = torch.empty_like(half_sum)
    _int8_query_kernel[(1,)](q, terms, half_sum, step, group, pc_pad, parts, interleaved)
    return terms.cpu(), half_sum.cpu(), step.cpu()


def _bytes_of(regs: int) -> torch.Tensor:
    return torch.tensor([(regs >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)


def _keys(bits: int, plane: torch.Tensor, signs: torch.Tensor, block: int, grid):
    """The int8 keys of the parts ``PAIRS[bits][block]``, from code bytes ``plane [N, PC_PAD]``
    (and, for 3 and 5 bits, sign bytes ``signs`` as the sign halves give them: bit ``2q`` the
    sign of 3-bit quarter ``q``; bit ``2 block`` / ``2 block + 4`` that of a 5-bit block's low
    / high nibble): ``(plain [2, N, PC_PAD], ptx [2, N, PC_PAD])`` int64, the plain order's
    parts and the emulated string's interleaved outputs (3 bits: outputs ``2 block``, ``2 block
    + 1``)."""
    outputs = (0, 1)
    if bits == 4:
        codes = [plane & 15, plane >> 4]
        asm = lut4_int8_asm(grid)
    elif bits == 3:
        codes = [((plane >> 2 * q) & 3) | (((signs >> 2 * q) & 1) << 2) for q in PAIRS[3][block]]
        asm = lut3_int8_asm(grid)
        outputs = (2 * block, 2 * block + 1)
    else:
        codes = [
            (plane & 15) | (((signs >> (2 * block)) & 1) << 4),
            (plane >> 4) | (((signs >> (2 * block + 4)) & 1) << 4),
        ]
        asm = lut5_int8_asm(grid, block)
    sign = 1 << (bits - 1)
    table = torch.tensor(grid, dtype=torch.int64)
    codes = torch.stack(codes).to(torch.int64)
    magnitude = table[codes & (sign - 1)]
    plain = torch.where(codes >= sign, -magnitude - 1, magnitude)
    ptx = torch.empty(2, *plane.shape, dtype=torch.uint8)
    for n in range(plane.shape[0]):
        for w in range(plane.shape[1] // 4):
            word = sum(int(b) << (8 * i) for i, b in enumerate(plane[n, 4 * w : 4 * w + 4]))
            sign_word = sum(int(b) << (8 * i) for i, b in enumerate(signs[n, 4 * w : 4 * w + 4]))
            # the sign bytes as the low sign half, the high half zero (a valid split of them)
            if bits == 3:
                inputs = {4: word, 5: sign_word, 6: 0}
            else:
                inputs = {2: word, 3: sign_word, 4: 0}
            regs = run(asm, inputs)
            for out, reg in enumerate(outputs):
                ptx[out, n, 4 * w : 4 * w + 4] = _bytes_of(regs[reg])
    return plain, ptx.view(torch.int8).to(torch.int64)


@pytest.mark.parametrize("bits", [3, 4, 5])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_interleaved_keys_and_query_give_the_plain_products(bits, head_dim, kernel_device, seeded):
    """Against the PTX's interleaved int8 keys (each byte's low and high nibble side by side:
    4-bit parts 0 and 1, 3-bit quarters 0 and 2, 1 and 3, or a 5-bit block's quarters), the
    permuted query gives the plain order's integer products, hi and lo terms alike, with the
    same ``half_sum`` (half the sum of ``254 hi + lo`` over every part) and ``step``; padded
    columns (D 80, 96: parts of 40 and 48 in 64, quarters of 20 and 24 in 32) stay zero. The
    plain query is each row to within ``step / 508``."""
    parts = len(PAIRS[bits]) * 2
    pc = head_dim // parts
    pc_pad = triton.next_power_of_2(pc)
    q = torch.zeros(GROUP, parts, pc_pad, dtype=torch.float16)
    q[:, :, :pc] = torch.randn(GROUP, parts, pc, generator=seeded).to(torch.float16) * 3
    plain, plain_half_sum, plain_step = _int8_query(q.to(kernel_device), False)
    mixed, mixed_half_sum, mixed_step = _int8_query(q.to(kernel_device), True)
    assert torch.equal(mixed_half_sum, plain_half_sum) and torch.equal(mixed_step, plain_step)
    every_part = (254 * plain[0].double() + plain[1].double()).sum(dim=(0, 1))
    assert torch.equal(plain_half_sum.double(), every_part / 2)
    assert not plain[:, :, pc:].any() and not mixed[:, :, pc:].any()
    kept = (254 * plain[0].double() + plain[1].double()) * (plain_step.double() / 254)
    error = (kept - q.permute(1, 2, 0).double()).abs()
    assert bool((error <= plain_step.double() / 508 * (1 + 1e-9)).all())

    grid, _ = int8_key_grid(bits, head_dim)
    expected = torch.zeros(2, TOKENS, GROUP, dtype=torch.int64)
    actual = torch.zeros_like(expected)
    for block, pair in enumerate(PAIRS[bits]):
        # masked-off bytes load as 0
        plane = torch.zeros(TOKENS, pc_pad, dtype=torch.uint8)
        plane[:, :pc] = torch.randint(0, 256, (TOKENS, pc), generator=seeded, dtype=torch.uint8)
        signs = torch.randint(0, 256, (TOKENS, pc_pad), generator=seeded, dtype=torch.uint8)
        plain_keys, ptx_keys = _keys(bits, plane, signs, block, grid)
        for term in (0, 1):  # hi, then lo
            for out, part in enumerate(pair):
                expected[term] += plain_keys[out] @ plain[term, part].long()
                actual[term] += ptx_keys[out] @ mixed[term, part].long()
    assert torch.equal(actual, expected)


@triton.jit
def _rotated_query_kernel(
    q_ptr,
    rot_ptr,
    terms_ptr,
    sums_ptr,
    group,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    PARTS: tl.constexpr,
    G_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """The rotated query ``q [group, D]``'s int8 operands, by ``rotated_int8_query`` (``WHOLE``)
    or by ``rotated_parts`` then ``int8_query``: ``terms [2, 4, D / PARTS, G_PAD]`` (hi, lo;
    four parts, unused ones repeating part 0) as float32, ``sums [2, G_PAD]`` (``half_sum``,
    ``step``)."""
    PC: tl.constexpr = D // PARTS
    g = tl.arange(0, G_PAD)
    row_ok = g < group
    query = (q_ptr, 0, D)
    b = tl.program_id(0)
    y = rotate_query(query, rot_ptr, b, g, row_ok, 0.75, D, LOG2_D, D**-0.5)
    if WHOLE:
        his, los, half_sum, step = rotated_int8_query(y, PARTS, PC, INTERLEAVED)
    else:
        q0, q1, q2, q3 = rotated_parts(y, PARTS, PC)
        his, los, half_sum, step = int8_query(
            tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3), PARTS, INTERLEAVED
        )
    out = terms_ptr + tl.arange(0, PC)[:, None] * G_PAD + g[None, :]
    for part in tl.static_range(4):
        tl.store(out + part * PC * G_PAD, his[part].to(tl.float32))
        tl.store(out + (4 + part) * PC * G_PAD, los[part].to(tl.float32))
    tl.store(sums_ptr + g, half_sum)
    tl.store(sums_ptr + G_PAD + g, step)


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("head_dim", [d for d in SUPPORTED_HEAD_DIMS if d & (d - 1) == 0])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("group", "g_pad"), [(4, 4), (5, 8), (8, 8)])
def test_rotated_query_rounded_whole_gives_the_two_steps_bits(
    parts, head_dim, interleaved, group, g_pad, kernel_device, seeded
):
    """An equivalence test (the float64 reference is ``test_int8_keys_at_every_head_dim``'s):
    ``rotated_int8_query`` rounds the rotated rows whole and cuts them into parts after; it
    gives ``rotated_parts`` then ``int8_query``'s operands, ``half_sum`` and ``step`` bit for
    bit, in both column orders, with padded rows (zero), a row of zeros and rows of very
    different sizes. With five rows or more, the last two hold a NaN and a value that
    overflows fp16 once rotated: their ``half_sum`` is not finite in both, so their scores are
    not finite whatever their int8 terms, which are the conversion of a NaN or an infinity and
    which the two paths' compiled code need not agree on (they differ on the H200)."""
    q = torch.randn(group, head_dim, generator=seeded, dtype=torch.float64)
    q *= torch.logspace(-3, 3, group, dtype=torch.float64)[:, None]
    q[1] = 0.0
    special = group >= 5  # rows group - 2 and group - 1: a NaN, an fp16 overflow
    if special:
        q[group - 2, 5] = float("nan")
        q[group - 1, 0] = 3e6  # times 0.75 / sqrt(D) > 65504 at every head dim
    q = q.to(torch.bfloat16).to(kernel_device)
    rotation = api.make_constants(get_format("4bit_nc"), head_dim).rotation.to(kernel_device)
    log2_d = head_dim.bit_length() - 1
    results = []
    for whole in (False, True):
        terms = torch.full((8, head_dim // parts, g_pad), 0.5, device=kernel_device)
        sums = torch.full((2, g_pad), 0.5, device=kernel_device)
        _rotated_query_kernel[(1,)](
            q, rotation, terms, sums, group, head_dim, log2_d, parts, g_pad, interleaved, whole
        )
        results.append((terms.cpu(), sums.cpu()))
    (terms, sums), (whole_terms, whole_sums) = results
    assert not (terms == 0.5).any() and not (whole_terms == 0.5).any()
    finite = sums.isfinite()
    assert torch.equal(whole_sums.isfinite(), finite)
    assert torch.equal(whole_sums[finite].view(torch.int32), sums[finite].view(torch.int32))
    expected = torch.ones(g_pad, dtype=torch.bool)
    if special:
        expected[group - 2 : group] = False
    assert torch.equal(finite[0], expected) and finite[1].all()
    rows = finite[0]  # half_sum's rows: the terms' last dim
    assert torch.equal(whole_terms[..., rows], terms[..., rows])
    # padded rows are zero, and the compared rows are not all trivial
    assert not terms[:, :, group:].any() and not whole_terms[:, :, group:].any()
    assert terms[..., rows].abs().sum() > 0
