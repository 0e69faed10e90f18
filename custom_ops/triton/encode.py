"""Encoding one side (keys or values) of token-head rows in registers, shared by the store
kernels (:mod:`custom_ops.triton.store`, :mod:`custom_ops.triton.store_window`).

It reproduces :func:`custom_ops.reference.encode_rows` operation by operation:

* Lloyd-Max: the row ``x`` divided by ``p``, the power of two at or below its absmax (exact, and
  neither the squares nor the rotated sums can overflow float32 for any finite bf16 row),
  ``s = ||x / p||``; ``y = (x / p @ R) * (1/sqrt(D) / s)`` with the +-1 rotation R: for a
  power-of-two D a Walsh-Hadamard butterfly in registers (:mod:`custom_ops.triton.hadamard`;
  a one-token append then waits for no block of R), otherwise on the tensor cores (tf32 is
  exact here: bf16 and fp16 inputs, their power-of-two multiples and +-1 fit in tf32's
  mantissa); magnitude index = number of magnitude midpoints below ``|y|``;
  sign-magnitude code; the stored norm is ``s * p``, with norm correction
  ``s / ||levels[codes]|| * p``.
* Uniform: scale ``(max - min) / (2^b - 1)`` and zero ``min`` rounded to the meta dtype; codes
  from those rounded values: ``floor((x - zero) / scale + 0.5)``, clamped (differences taken
  of halves, which is exact and cannot overflow).
* Absmax: scale ``absmax / 448`` (fp8) or ``/ 127`` (int8) rounded to the meta dtype; saturated
  e4m3 casts of ``x / scale``, ``floor(x / scale + 0.5)`` for int8.

A row holding a NaN stores a NaN norm or scale (Lloyd-Max norms propagate it by themselves;
scales from min / max get it explicitly), so it reads back as NaN on every path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.formats import FP8_MAX, INT8_MAX
from custom_ops.triton.hadamard import rotate_rows
from custom_ops.triton.kinds import FP8_ABSMAX, INT8_ABSMAX, LLOYD_MAX, UNIFORM
from custom_ops.triton.planes import rotation_slice, store_codes, tile_offsets

__all__ = ["encode_side"]

_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)


@triton.jit
def _row_sum(x):
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _reciprocal_or_zero(x):
    """``1 / x`` (IEEE) where ``x > 0``, else 0: one division per row, multiplies per element."""
    positive = x > 0
    return tl.where(
        positive,
        tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.where(positive, x, 1.0)),
        0.0,
    )


@triton.jit
def power_of_two_floor(x):
    """The power of two at or below ``x >= 0`` (float32, from its exponent bits), capped at
    2^126 so that its reciprocal is a normal number; 0 for zero and subnormal ``x``."""
    exponent = x.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.minimum(exponent, 0x7E800000).to(tl.float32, bitcast=True)


@triton.jit
def _nan_if_any_nan(scalar, x):
    """``scalar [BLOCK_R]``, NaN for rows of ``x [BLOCK_R, G, C_PAD]`` holding a NaN: the GPU's
    min and max skip NaN (the interpreter's do not), so a scale from them would hide it; a NaN
    scale makes the row decode to NaN, as dense attention over it would."""
    return tl.where(_row_sum((x != x).to(tl.float32)) > 0, float("nan"), scalar)


@triton.jit
def _lloyd_max_codes(y, P: tl.constexpr):
    """Sign-magnitude codes of the rotated, normalized elements ``y [BLOCK_R, G, N]`` (the
    magnitude index: how many magnitude midpoints lie below ``|y|``) and their levels'
    squares ``[BLOCK_R, G, N]`` (for the norm correction)."""
    BITS: tl.constexpr = P.BITS
    magnitude = tl.abs(y)
    mag_index = tl.zeros(y.shape, dtype=tl.int32)
    level = tl.full(y.shape, P.LEVELS[0], tl.float32)
    for m in tl.static_range((1 << (BITS - 1)) - 1):
        above = magnitude > (P.LEVELS[m] + P.LEVELS[m + 1]) * 0.5
        mag_index += above.to(tl.int32)
        level = tl.where(above, tl.full(y.shape, P.LEVELS[m + 1], tl.float32), level)
    codes = ((y < 0).to(tl.int32) << (BITS - 1)) | mag_index
    return codes, level * level


@triton.jit
def encode_side(
    x_ptr,
    x_rows,
    stride_xd,
    ok,
    code_ptr,
    meta_ptr,
    rot_ptr,
    P: tl.constexpr,
    D: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Encode one side of ``BLOCK_R`` rows with the codec ``P`` (a
    :class:`~custom_ops.triton.planes.CodecParams`) and store codes and meta.

    ``x_rows [BLOCK_R]`` are the rows' element offsets from ``x_ptr`` (elements ``stride_xd``
    apart); ``code_ptr [BLOCK_R]`` / ``meta_ptr [BLOCK_R]`` point at each row's code row and
    meta record; rows not ``ok`` are neither read nor written.
    """
    G: tl.constexpr = P.G
    C: tl.constexpr = P.C
    C_PAD: tl.constexpr = P.C_PAD
    e, e_mask = tile_offsets(G, C, C_PAD)  # [1, G, C_PAD]
    mask = ok[:, None, None] & e_mask
    x_offs = x_rows[:, None, None] + e * stride_xd
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, G, C_PAD]
    meta_ty = meta_ptr.dtype.element_ty

    if P.KIND == LLOYD_MAX:
        RC: tl.constexpr = P.RC
        # divided by a power of two near its absmax (exact), the row's squares and rotated sums
        # stay in float32's range; the codes are those of the unscaled row
        pow2 = power_of_two_floor(tl.max(tl.max(tl.abs(x), axis=2), axis=1))
        inv_pow2 = _reciprocal_or_zero(pow2)
        x = x * inv_pow2[:, None, None]
        norm = tl.sqrt_rn(_row_sum(x * x))  # of the scaled row: 0 for zero rows, else >= 1
        inv = tl.where(
            norm > 0,
            tl.math.div_rn(
                tl.full([BLOCK_R], INV_SQRT_D, tl.float32), tl.where(norm > 0, norm, 1.0)
            ),
            0.0,
        )
        if P.LOG2_D > 0:
            # power-of-two D: x @ R = (x * s) @ H by the butterfly in registers; the tile is in
            # natural element order (C == C_PAD), and only R's first column s is read
            tl.static_assert(C == C_PAD, "a power-of-two head dim has unpadded groups")
            y = rotate_rows(tl.reshape(x, (BLOCK_R, D)), rot_ptr, 1.0, D, P.LOG2_D)
            y = tl.reshape(y, (BLOCK_R, G, C)) * inv[:, None, None]
            codes, level_sq = _lloyd_max_codes(y, P)
            recon_sq = _row_sum(level_sq)
            store_codes(codes, code_ptr, ok, P, BLOCK_R, 0, C)
        else:
            recon_sq = tl.zeros([BLOCK_R], tl.float32)
            # y = x @ R / sqrt(D) / norm: RC output columns per group at a time, contracting KC
            # tile positions at a time (x re-read from L1), so no rotation block needs > 32 KiB.
            KC: tl.constexpr = 32
            for col0 in tl.static_range(0, C_PAD, RC):
                y = tl.zeros([BLOCK_R, G * RC], tl.float32)
                for k0 in tl.static_range(0, G * C_PAD, KC):
                    i = k0 + tl.arange(0, KC)
                    i_elem = (i // C_PAD) * C + i % C_PAD
                    x_offs = x_rows[:, None] + i_elem * stride_xd
                    x_mask = ok[:, None] & ((i % C_PAD) < C)[None, :]
                    x_k = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
                    x_k = x_k * inv_pow2[:, None]
                    rot = rotation_slice(rot_ptr, D, G, C, C_PAD, k0, KC, col0, RC, False)
                    y = tl.dot(x_k, rot, y, input_precision="tf32")
                y = tl.reshape(y, (BLOCK_R, G, RC)) * inv[:, None, None]
                codes, col_sq = _lloyd_max_codes(y, P)
                if P.NC:
                    col_ok = (col0 + tl.arange(0, RC))[None, None, :] < C
                    recon_sq += _row_sum(tl.where(col_ok, col_sq, 0.0))
                store_codes(codes, code_ptr, ok, P, BLOCK_R, col0, RC)
        if P.NC:
            norm = tl.math.div_rn(norm, tl.sqrt_rn(recon_sq))
        tl.store(meta_ptr + P.META, (norm * pow2).to(meta_ty), mask=ok)
    elif P.KIND == UNIFORM:
        QMAX: tl.constexpr = (1 << P.BITS) - 1
        lo = tl.min(tl.min(tl.where(e_mask, x, float("inf")), axis=2), axis=1)
        hi = tl.max(tl.max(tl.where(e_mask, x, float("-inf")), axis=2), axis=1)
        scale = tl.math.div_rn(hi * 0.5 - lo * 0.5, tl.full([BLOCK_R], QMAX * 0.5, tl.float32))
        scale = _nan_if_any_nan(scale, x).to(meta_ty).to(tl.float32)
        zero = lo.to(meta_ty).to(tl.float32)
        inv = _reciprocal_or_zero(scale)[:, None, None]
        q = tl.floor((x * 0.5 - zero[:, None, None] * 0.5) * inv * 2.0 + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), QMAX)
        tl.store(meta_ptr + P.META, scale.to(meta_ty), mask=ok)
        tl.store(meta_ptr + P.META + 1, zero.to(meta_ty), mask=ok)
        store_codes(q.to(tl.int32), code_ptr, ok, P, BLOCK_R, 0, C_PAD)
    else:
        QMAX_ABS: tl.constexpr = _FP8_MAX if P.KIND == FP8_ABSMAX else _INT8_MAX
        absmax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        scale = tl.math.div_rn(absmax, tl.full([BLOCK_R], QMAX_ABS, tl.float32))
        scale = _nan_if_any_nan(scale, x).to(meta_ty).to(tl.float32)
        tl.store(meta_ptr + P.META, scale.to(meta_ty), mask=ok)
        scaled = x * _reciprocal_or_zero(scale)[:, None, None]
        if P.KIND == INT8_ABSMAX:
            q = tl.minimum(tl.maximum(tl.floor(scaled + 0.5), -128.0), 127.0)
            byte = q.to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            # the stored scale may round below absmax / 448: saturate
            scaled = tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)
            byte = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # 8-bit codes: one plane, G == 1, element e at byte e.
        tl.store(code_ptr[:, None, None] + e * P.BYTE_STRIDE, byte, mask=mask)
