"""The Walsh-Hadamard butterfly: products with the +-1 rotation of a power-of-two head dim.

For a power-of-two ``D`` the rotation is ``R = diag(s) @ H``
(:func:`custom_ops.codebook.rotation_matrix`; ``H`` Walsh-Hadamard in Sylvester order, ``s =
R[:, 0]``), so ``x @ R = (x * s) @ H`` and ``y @ R.T = (y @ H) * s``: ``log2(D)`` stages of
adds in registers instead of a ``[D, D]`` product whose float32 blocks a kernel would have to
load. :func:`rotate_rows` serves the encoders (:mod:`custom_ops.triton.encode`) and the
in-split query rotation, :func:`walsh_hadamard_rows` the merge's way back
(:mod:`custom_ops.triton.decode`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["walsh_hadamard_rows", "rotate_rows"]


@triton.jit
def walsh_hadamard_rows(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``x @ H`` for ``x [M, D]`` float32 and the Walsh-Hadamard matrix ``H`` of a power-of-two
    ``D`` (Sylvester order, ``H[i, j] = (-1)^popcount(i & j)``, the ``H`` of
    :func:`custom_ops.codebook.rotation_matrix`): ``log2(D)`` butterfly stages, stage ``k``
    mapping the pair of elements ``i``, ``i + 2^k`` (bit ``k`` of ``i`` clear) to their sum and
    difference."""
    M: tl.constexpr = x.shape[0]
    for k in tl.static_range(LOG2_D):
        pairs = tl.permute(tl.reshape(x, [M, D >> (k + 1), 2, 1 << k]), [0, 1, 3, 2])
        low, high = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(low + high, low - high), [0, 1, 3, 2]), [M, D])
    return x


@triton.jit
def rotate_rows(x, rot_ptr, scale, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``(x @ R) * scale`` for rows ``x [M, D]`` float32 and the rotation ``R [D, D]`` float32 at
    ``rot_ptr`` of a power-of-two ``D``: ``(x * (s * scale)) @ H`` by the butterfly, reading
    only ``s = R[:, 0]``. The scale multiplies the inputs, before the adds (``s * scale`` is
    exact: ``s`` is +-1)."""
    signs = tl.load(rot_ptr + tl.arange(0, D) * D)
    return walsh_hadamard_rows(x * (signs * scale)[None, :], D, LOG2_D)
