"""The codec kinds of :class:`custom_ops.formats.Kind` as ``tl.constexpr`` globals, so kernels
compare a codec's ``KIND`` against names instead of numbers."""

import triton.language as tl

from custom_ops.formats import Kind

LLOYD_MAX = tl.constexpr(int(Kind.LLOYD_MAX))
UNIFORM = tl.constexpr(int(Kind.UNIFORM))
FP8_ABSMAX = tl.constexpr(int(Kind.FP8_ABSMAX))
INT8_ABSMAX = tl.constexpr(int(Kind.INT8_ABSMAX))
