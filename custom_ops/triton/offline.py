"""Compiling kernels for a GPU without one: the machine code a kernel gets on sm_90.

Triton compiles through its bundled ptxas, so a CPU machine can build a kernel's cubin for a
Hopper GPU: ``benchmarks/sass_report.py`` counts its SASS, and the tests compile every kernel
this way, because the interpreter that runs them on the CPU accepts programs the compiler
rejects (a tuple of floats passed on as an argument, an early ``return`` in a constexpr branch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from triton.backends.compiler import GPUTarget

from custom_ops import compat

__all__ = ["compile_offline", "offline_target"]


class _OfflineCudaDriver:
    """Just enough of Triton's CUDA driver to compile (``warmup``) without a GPU."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def offline_target(arch: int = 90) -> Iterator[None]:
    """Within: Triton compiles for ``sm_<arch>`` as if that GPU were the current device."""
    with compat.active_triton_driver(_OfflineCudaDriver(arch)):
        yield


def compile_offline(kernel, grid, *args, arch: int = 90, **kwargs):
    """Compile ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>`` and return the compiled
    kernel (``.asm['cubin']``, ``.asm['ptx']``) without launching it."""
    with offline_target(arch):
        return kernel.warmup(*args, grid=grid, **kwargs)
