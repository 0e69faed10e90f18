"""Lloyd-Max codebooks and random-sign Hadamard rotations for TurboQuant keys and values.

After a random rotation, one coordinate of a unit vector in R^D follows the law of a coordinate
of a uniformly random point on the sphere: density proportional to (1 - x^2)^((D - 3) / 2) on
[-1, 1] (a scaled Beta law, close to N(0, 1/D)). The codebooks here are the Lloyd-Max
(minimum mean-squared error) quantizers of that exact law, computed once per (bits, D) and cached.

Code convention (shared with every kernel): codes are **sign-magnitude**. A b-bit code is
``sign << (b - 1) | magnitude_index`` with magnitudes in ascending order, so the symmetric
codebook needs a table of 2^(b-1) magnitudes and one sign bit. Levels are rounded to float16
once, here, because the decode kernels multiply them on fp16 tensor cores: the reference and
every kernel then use bit-identical levels. 3-, 4- and 5-bit magnitudes are rounded further,
onto the grid ``(r + 1/2) * unit`` (``r`` 0..127, ``unit`` of 3 significant bits:
:func:`int8_key_grid`), so that the decode kernel multiplies such keys on int8 tensor cores:
``r`` or ``~r = -r - 1`` is the code's int8, and ``(r + 1/2) * unit`` is still an fp16 value.

Rotation convention: ``R = diag(signs) @ H.T`` is a +-1 matrix (H a Hadamard matrix of order D),
and the orthogonal rotation is ``Pi = R.T / sqrt(D)``, so for row vectors ``y = x @ R / sqrt(D)``
and ``x = y @ R.T / sqrt(D)``. Keeping R at +-1 makes it exact in fp16/bf16, so kernels rotate
with one tensor-core matmul and no rounding of the matrix. Hadamard matrices exist for every
supported head dim: Sylvester for powers of two, Paley's construction (times a Sylvester factor)
for 80 = 80 * 1 and 96 = 48 * 2.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

__all__ = [
    "INT8_GRID_BITS",
    "int8_key_grid",
    "lloyd_max_magnitudes",
    "signed_levels",
    "hadamard",
    "rotation_matrix",
    "signed_level_values",
]


@functools.cache
def lloyd_max_magnitudes(bits: int, head_dim: int) -> tuple[float, ...]:
    """Lloyd-Max magnitudes for one coordinate of a random unit vector in R^head_dim.

    Args:
        bits: code width b (1..8); the symmetric codebook has 2^(b-1) magnitudes.
        head_dim: the dimension D of the sphere (>= 3).

    Returns:
        The 2^(b-1) non-negative reconstruction magnitudes in ascending order, as float64.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if head_dim < 3:
        raise ValueError(f"head_dim must be >= 3, got {head_dim}")
    # The law is symmetric, so the optimal codebook is too: solve on [0, 1] for the magnitudes.
    # Cumulative integrals F(t) = int_0^t f and G(t) = int_0^t x f on a fine grid give each
    # cell's mass and first moment by interpolation; Lloyd's iteration then converges quickly.
    x = np.linspace(0.0, 1.0, (1 << 20) + 1)
    density = np.maximum(1.0 - x * x, 0.0) ** (0.5 * (head_dim - 3))
    step = x[1] - x[0]
    mass = np.concatenate([[0.0], np.cumsum(0.5 * (density[1:] + density[:-1]) * step)])
    xf = x * density
    moment = np.concatenate([[0.0], np.cumsum(0.5 * (xf[1:] + xf[:-1]) * step)])

    n = 1 << (bits - 1)
    # Start from quantiles of the law: every cell non-empty.
    cdf = mass / mass[-1]
    levels = np.interp((np.arange(n) + 0.5) / n, cdf, x)
    for _ in range(10_000):
        bounds = np.concatenate([[0.0], 0.5 * (levels[1:] + levels[:-1]), [1.0]])
        cell_mass = np.diff(np.interp(bounds, x, mass))
        cell_moment = np.diff(np.interp(bounds, x, moment))
        new_levels = cell_moment / cell_mass
        if np.max(np.abs(new_levels - levels)) < 1e-13:
            levels = new_levels
            break
        levels = new_levels
    return tuple(float(v) for v in levels)


# Bits whose magnitudes lie on the int8 grid of int8_key_grid.
INT8_GRID_BITS = (3, 4, 5)


@functools.cache
def int8_key_grid(bits: int, head_dim: int) -> tuple[tuple[int, ...], float]:
    """The int8 grid of the ``bits``-bit magnitudes: ``(r, unit)`` with magnitude ``m`` equal
    to ``(r[m] + 1/2) * unit``.

    ``unit`` is the smallest number of 3 significant bits (``c * 2**k``, ``c`` one of 1, 1.25,
    1.5, 1.75) that keeps ``r`` within 0..127 (an int8 ``r``, or ``~r`` for a negative code),
    so every magnitude is the Lloyd-Max one to within ``unit / 2`` (under 0.5% of the
    largest) and ``(2 r + 1) * unit / 2`` has at most 11 significant bits: exact in fp16 and in
    float32. Rounding onto it raises the codebook's mean-squared error by at most 0.12% for
    3 bits, 0.08% (D 128) to 0.28% (D 256) for 4 bits (a power-of-two unit: up to 0.82%), and
    0.56% (D 256) to 1.77% (D 96) for 5 bits, whose levels are closer together.

    Args:
        bits: code width, one of :data:`INT8_GRID_BITS`.
        head_dim: the dimension D of the sphere (>= 3).

    Returns:
        The ``2**(bits - 1)`` int magnitudes ``r`` in ascending order, and ``unit``.

    Raises:
        ValueError: ``bits`` is not one of :data:`INT8_GRID_BITS`.
    """
    if bits not in INT8_GRID_BITS:
        raise ValueError(f"bits must be one of {INT8_GRID_BITS} for an int8 grid, got {bits}")
    exact = lloyd_max_magnitudes(bits, head_dim)
    largest = exact[-1]
    exponent = math.floor(math.log2(largest / 127.5))  # 2**exponent <= largest / 127.5
    unit = next(
        c * 2.0**k
        for k in (exponent, exponent + 1)
        for c in (1.0, 1.25, 1.5, 1.75)
        if round(largest / (c * 2.0**k) - 0.5) <= 127
    )
    return tuple(round(m / unit - 0.5) for m in exact), unit


@functools.cache
def signed_level_values(bits: int, head_dim: int) -> tuple[float, ...]:
    """:func:`signed_levels` as Python floats (hashable: the kernels take them as constexprs).
    Computed in numpy: an op traced for compilation may ask first, under a fake-tensor mode."""
    if bits in INT8_GRID_BITS:
        grid, unit = int8_key_grid(bits, head_dim)
        mags = (np.asarray(grid, dtype=np.float32) + 0.5) * np.float32(unit)
    else:
        mags = np.asarray(lloyd_max_magnitudes(bits, head_dim)).astype(np.float16)
        mags = mags.astype(np.float32)
    return tuple(np.concatenate([mags, -mags]).tolist())


def signed_levels(bits: int, head_dim: int) -> torch.Tensor:
    """Reconstruction level of every sign-magnitude code.

    Returns:
        ``[2^bits] float32``: entry ``s << (bits-1) | m`` is ``(-1)^s * magnitude[m]``, with the
        magnitudes rounded to float16, 3-, 4- and 5-bit ones to :func:`int8_key_grid` (exactly
        what the kernels multiply with).
    """
    return torch.tensor(signed_level_values(bits, head_dim), dtype=torch.float32, device="cpu")


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, math.isqrt(n) + 1))


def _paley(order: int) -> np.ndarray:
    """Paley construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4)."""
    q = order - 1
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in residues else -1 for i in range(1, q)], dtype=np.int64)
    jacobsthal = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    skew = np.zeros((order, order), dtype=np.int64)
    skew[0, 1:] = 1
    skew[1:, 0] = -1
    skew[1:, 1:] = jacobsthal
    return np.eye(order, dtype=np.int64) + skew


@functools.cache
def _hadamard_np(order: int) -> np.ndarray:
    if order == 1:
        return np.ones((1, 1), dtype=np.int64)
    if order % 2 == 0 and order & (order - 1) == 0:
        half = _hadamard_np(order // 2)
        return np.block([[half, half], [half, -half]])
    # order = 2^a * (q + 1) with q a prime = 3 (mod 4): Paley times Sylvester.
    power = 1
    while order % power == 0:
        core = order // power
        if core % 4 == 0 and _is_prime(core - 1) and (core - 1) % 4 == 3:
            return np.kron(_paley(core), _hadamard_np(power))
        power *= 2
    raise ValueError(f"no Hadamard construction implemented for order {order}")


def hadamard(order: int) -> torch.Tensor:
    """A Hadamard matrix (entries +-1, ``H @ H.T == order * I``): ``[order, order] float32``,
    always built on the CPU (constants are moved by their users)."""
    return torch.from_numpy(_hadamard_np(order).astype(np.float32))


def rotation_matrix(head_dim: int, seed: int) -> torch.Tensor:
    """The +-1 rotation matrix ``R = diag(signs) @ H.T`` for a seeded random-sign Hadamard.

    The orthogonal rotation applied to keys (and Lloyd-Max values) is ``Pi = R.T / sqrt(D)``:
    ``y = x @ R / sqrt(D)`` for row vectors. The signs come from a CPU generator seeded with
    ``seed``, so every device and process builds the same matrix.

    Returns:
        ``[head_dim, head_dim] float32`` with entries +-1 (on the CPU).
    """
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64, device="cpu")
    signs = signs * 2 - 1
    return (signs.to(torch.float32)[:, None] * hadamard(head_dim).T).contiguous()
