"""tq-compile: TurboQuant KV caches for ``torch.compile``'d PyTorch models (user layer)."""

from tq_compile.cache import TurboQuantKVCache
from tq_compile.kv_tensor import TurboQuantKVTensor

__all__ = ["TurboQuantKVCache", "TurboQuantKVTensor"]
