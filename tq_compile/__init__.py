"""tq-compile: TurboQuant KV caches for ``torch.compile``'d PyTorch models (user layer)."""

from tq_compile.cache import TurboQuantKVCache, kv_cache_nbytes
from tq_compile.config import TurboQuantKVConfig, is_kv_cache, quantize_
from tq_compile.graphs import DecodeGraph
from tq_compile.kv_tensor import TurboQuantKVTensor

__all__ = [
    "DecodeGraph",
    "TurboQuantKVCache",
    "TurboQuantKVConfig",
    "TurboQuantKVTensor",
    "is_kv_cache",
    "kv_cache_nbytes",
    "quantize_",
]
