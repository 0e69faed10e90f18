"""tq-compile: TurboQuant KV caches for ``torch.compile``'d PyTorch models (user layer)."""

import contextlib
import logging


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Hide warnings that importing torchao logs and a user cannot act on: its optional C++
    kernels (which tq-compile does not use) failing to load or being skipped, and torch's
    notes on the Enum constants it registers."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


with _quiet_loggers("torchao", "torch.utils._pytree"):
    import torchao  # noqa: F401

from tq_compile.cache import TurboQuantKVCache, kv_cache_nbytes  # noqa: E402
from tq_compile.config import TurboQuantKVConfig, is_kv_cache, quantize_  # noqa: E402
from tq_compile.graphs import DecodeGraph  # noqa: E402
from tq_compile.kv_tensor import TurboQuantKVTensor  # noqa: E402
from tq_compile.options import CacheOptions  # noqa: E402

__all__ = [
    "CacheOptions",
    "DecodeGraph",
    "TurboQuantKVCache",
    "TurboQuantKVConfig",
    "TurboQuantKVTensor",
    "is_kv_cache",
    "kv_cache_nbytes",
    "quantize_",
]
