"""Lloyd-Max codebooks and Hadamard rotations."""

from __future__ import annotations

import math

import pytest
import torch

from custom_ops.codebook import (
    hadamard,
    int8_key_grid,
    lloyd_max_magnitudes,
    rotation_matrix,
    signed_levels,
)
from custom_ops.formats import SUPPORTED_HEAD_DIMS

# TurboQuant paper, Table: MSE of the optimal b-bit scalar quantizer of a Gaussian coordinate,
# i.e. E||x - x_hat||^2 for unit vectors at large D.
PAPER_DISTORTION = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_matches_paper(bits, seeded):
    """Mean ||x - x_hat||^2 over 2e4 random unit vectors (D=128, rotated) is within 3% of the
    paper's Lloyd-Max distortion for b = 1..4."""
    head_dim = 128
    x = torch.randn(20_000, head_dim, generator=seeded, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    rot = rotation_matrix(head_dim, seed=7).double() / math.sqrt(head_dim)
    y = x @ rot
    levels = signed_levels(bits, head_dim).double()
    mags = levels[: 1 << (bits - 1)]
    index = torch.bucketize(y.abs(), (mags[1:] + mags[:-1]) / 2)
    y_hat = mags[index] * torch.where(y < 0, -1.0, 1.0)
    x_hat = y_hat @ rot.T
    distortion = ((x - x_hat) ** 2).sum(dim=1).mean().item()
    assert distortion == pytest.approx(PAPER_DISTORTION[bits], rel=0.03)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_lloyd_max_is_a_fixed_point(head_dim):
    """Each magnitude is the conditional mean of its cell under the exact sphere law."""
    x = torch.linspace(0, 1, 400_001, dtype=torch.float64)
    density = (1 - x * x).clamp_min(0) ** ((head_dim - 3) / 2)
    mags = torch.tensor(lloyd_max_magnitudes(3, head_dim), dtype=torch.float64)
    bounds = torch.cat([torch.zeros(1), (mags[1:] + mags[:-1]) / 2, torch.ones(1)]).double()
    for i in range(len(mags)):
        cell = (x >= bounds[i]) & (x < bounds[i + 1])
        centroid = (x[cell] * density[cell]).sum() / density[cell].sum()
        assert mags[i].item() == pytest.approx(centroid.item(), rel=1e-4)


def test_levels_are_fp16_sign_magnitude():
    """Levels are fp16 values; code s<<(b-1)|m decodes to (-1)^s * magnitude[m], ascending m."""
    levels = signed_levels(4, 128)
    assert torch.equal(levels, levels.half().float())
    assert torch.equal(levels[8:], -levels[:8])
    assert bool((levels[1:8] > levels[:7]).all()) and bool((levels[:8] > 0).all())


@pytest.mark.parametrize("bits", [3, 4, 5])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_int8_key_grid(bits, head_dim):
    """3-, 4- and 5-bit magnitudes are ``(r + 1/2) * unit``: ``r`` ascending within 0..127,
    ``unit`` of 3 significant bits and as fine as they allow (the next smaller such number
    would take the top ``r`` past 127), each level the Lloyd-Max one to within ``unit / 2`` and
    exact in fp16."""
    grid, unit = int8_key_grid(bits, head_dim)
    mags = signed_levels(bits, head_dim)[: 1 << (bits - 1)].double()
    r = torch.tensor(grid, dtype=torch.float64)
    assert bool((r[1:] > r[:-1]).all()) and grid[0] >= 0 and grid[-1] <= 127
    exponent = math.floor(math.log2(unit))
    significands = (0.875, 1.0, 1.25, 1.5, 1.75)  # 0.875: 1.75 of the exponent below
    index = significands.index(unit / 2.0**exponent)
    smaller = significands[index - 1] * 2.0**exponent
    assert round(lloyd_max_magnitudes(bits, head_dim)[-1] / smaller - 0.5) > 127
    assert torch.equal(mags, (r + 0.5) * unit)
    assert torch.equal(mags, mags.half().double())
    exact = torch.tensor(lloyd_max_magnitudes(bits, head_dim), dtype=torch.float64)
    assert bool(((mags - exact).abs() <= unit / 2).all())


def test_int8_key_grid_rejects_other_bits():
    with pytest.raises(ValueError, match="bits must be one of"):
        int8_key_grid(2, 128)


@pytest.mark.parametrize("order", sorted({*SUPPORTED_HEAD_DIMS, 12, 20, 48}))
def test_hadamard(order):
    """H has entries +-1 and H @ H.T == order * I (Sylvester, or Paley times Sylvester)."""
    h = hadamard(order)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, order * torch.eye(order), rtol=0, atol=0)


def test_hadamard_rejects_orders_without_construction():
    with pytest.raises(ValueError, match="no Hadamard construction"):
        hadamard(56)


def test_rotation_is_seeded_and_orthogonal():
    """R / sqrt(D) is orthogonal; the seed fixes the signs, different seeds differ."""
    r = rotation_matrix(96, seed=3)
    torch.testing.assert_close(r @ r.T / 96, torch.eye(96), rtol=0, atol=1e-6)
    assert torch.equal(r, rotation_matrix(96, seed=3))
    assert not torch.equal(r, rotation_matrix(96, seed=4))
    assert r.is_contiguous()


@pytest.mark.parametrize("head_dim", [d for d in SUPPORTED_HEAD_DIMS if d & (d - 1) == 0])
def test_power_of_two_rotation_is_walsh_hadamard(head_dim):
    """What the decode kernels rely on for power-of-two head dims (they generate H instead of
    reading R): ``R[i, j] = s_i (-1)^popcount(i & j)`` with ``s = R[:, 0]``."""
    r = rotation_matrix(head_dim, seed=5)
    i = torch.arange(head_dim)
    parity = torch.tensor([bin(x).count("1") % 2 for x in range(head_dim)])
    walsh = 1.0 - 2.0 * parity[i[:, None] & i[None, :]].float()
    torch.testing.assert_close(r, r[:, :1] * walsh, rtol=0, atol=0)
