"""Kernel layer of tq-compile: formats, reference codec, Triton kernels and ``torch.ops.tq``.

Importing this package registers the ``torch.ops.tq`` operators.
"""

from custom_ops import compat

compat.require()  # a clear error on an unsupported torch / Triton, before anything uses them

from custom_ops import ops  # noqa: E402
from custom_ops.api import (  # noqa: E402
    KVConstants,
    decode,
    dequantize,
    make_constants,
    store,
    store_window,
)
from custom_ops.formats import (  # noqa: E402
    FORMATS,
    SUPPORTED_HEAD_DIMS,
    KVFormat,
    PagedKVCache,
    get_format,
)

__all__ = [
    "FORMATS",
    "SUPPORTED_HEAD_DIMS",
    "KVConstants",
    "KVFormat",
    "PagedKVCache",
    "decode",
    "dequantize",
    "get_format",
    "make_constants",
    "ops",
    "store",
    "store_window",
]
