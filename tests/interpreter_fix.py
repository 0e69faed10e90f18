"""Test-only fixes for Triton's CPU interpreter where it computes otherwise than the GPU.

* Float conversions (triton issue #8322): the interpreter converts between float formats bit by
  bit and gets float8 wrong (no saturation, lost carries, wrong ties) and truncates float32 ->
  bfloat16. The GPU rounds to nearest even and saturates float8 (``cvt.rn.satfinite``), which
  is what torch's own conversions do, so the fix routes every interpreter float conversion
  through torch.
* ``tl.maximum`` / ``tl.minimum`` (default ``propagate_nan=NONE``) lower to LLVM's
  ``maxnum`` / ``minnum``, which return the other operand when one is NaN (PTX ``max``/``min``);
  the interpreter uses ``np.maximum`` / ``np.minimum``, which return NaN. The fix uses
  ``np.fmax`` / ``np.fmin``, which behave like the GPU.
* ``tl.dot`` of bfloat16 operands: the interpreter keeps bfloat16 as uint16 and multiplies the
  integers. The GPU's tensor cores multiply the bf16 values exactly and accumulate in float32;
  the fix converts bf16 operands to float32 (exact) before the product.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_TORCH_DTYPES = {
    tl.float64: torch.float64,
    tl.float32: torch.float32,
    tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
    tl.float8e5: torch.float8_e5m2,
}
_STORAGE = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32, 64: torch.uint64}
_original = interpreter._convert_float


def _convert_float(data, input_dtype, output_dtype, rounding_mode):
    src_dtype = _TORCH_DTYPES.get(input_dtype)
    dst_dtype = _TORCH_DTYPES.get(output_dtype)
    truncating = rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ
    if src_dtype is None or dst_dtype is None or truncating:
        return _original(data, input_dtype, output_dtype, rounding_mode)
    array = np.ascontiguousarray(data)
    bits = torch.from_numpy(array.view(f"uint{input_dtype.primitive_bitwidth}"))
    converted = bits.view(src_dtype).to(dst_dtype)
    return converted.view(_STORAGE[output_dtype.primitive_bitwidth]).numpy()


_original_dot = interpreter.InterpreterBuilder.create_dot


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
        a, b = (
            self.create_fp_ext(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x
            for x in (a, b)
        )
    return _original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def install() -> None:
    """Patch the interpreter (idempotent)."""
    interpreter._convert_float = _convert_float
    interpreter.InterpreterBuilder.create_dot = _create_dot
    builder = interpreter.InterpreterBuilder
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
