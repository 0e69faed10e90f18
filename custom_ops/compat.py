"""Every private PyTorch, inductor and Triton interface the project uses, in one place.

Each is a name that is not part of the library's public API and may move in any release: the
dispatch-stack probes that tell an eager call from a traced one, the raw CUDA stream a compiled
kernel is launched on, the compiled kernel's own launcher, the fake-tensor test, the subclass
switch of ``__torch_function__``, ``mark_static_address``, SDPA's backend choice (the private
SDPA kernels themselves are called by :mod:`custom_ops.sdpa_lse`, which names them), inductor's
tracing state, config and autotuner, and Triton's active driver (offline compiles).

:func:`missing` lists the ones this PyTorch / Triton lacks and :func:`require` (called when
:mod:`custom_ops` is imported) raises a clear error naming them and the versions found, instead
of an ``AttributeError`` deep inside a step. The versions this is tested with: torch 2.13,
Triton 3.6 (``docs/design/host-path.md``, "Private torch and Triton calls").
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import triton
from torch._C import DisableTorchFunctionSubclass
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode

__all__ = [
    "DisableTorchFunctionSubclass",
    "FunctionalTensorMode",
    "is_fake",
    "dispatch_is_plain",
    "current_raw_stream",
    "launch_compiled",
    "fused_sdp_choice",
    "mark_static_address",
    "inductor_is_tracing",
    "inductor_cudagraphs",
    "loaded_inductor_config",
    "loaded_inductor_autotuner",
    "active_triton_driver",
    "missing",
    "require",
]

# (module, attribute path) of each private interface used below: those every process uses
# (checked at import), those of compiling processes (dynamo, inductor: checked by missing(), not
# imported for an eager user), and the CUDA-only ones (checked where torch is built with CUDA)
_PRIVATE = (
    ("torch._C", "_len_torch_dispatch_stack"),
    ("torch._ops", "_len_torch_dispatch_stack_pre_dispatch"),
    ("torch._C", "_get_tracing_state"),
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch", "_fused_sdp_choice"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu"),
    ("triton.runtime.driver", "driver.set_active"),
    ("triton.runtime.driver", "driver._active"),
)
_PRIVATE_COMPILING = (
    ("torch._dynamo", "mark_static_address"),
    ("torch._inductor.virtualized", "V"),
    ("torch._inductor.virtualized", "NullHandler"),
    ("torch._inductor.config", "triton.cudagraphs"),
    ("torch._inductor.config", "static_launch_user_defined_triton_kernels"),
    ("torch._inductor.runtime.triton_heuristics", "CachingAutotuner._create_compile_options"),
)
_PRIVATE_CUDA = (
    ("torch._C", "_cuda_getCurrentRawStream"),
    ("torch", "ops.aten._scaled_dot_product_cudnn_attention"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention"),
)


def dispatch_is_plain() -> bool:
    """Whether no ``TorchDispatchMode`` (fake tensors, functionalization, a recorder of ops; the
    pre-dispatch ones of ``make_fx`` included), no ``torch.jit`` trace and no functorch
    transform (``vmap``, ``grad``, ``functionalize``) sees the ops called now."""
    return (
        torch._C._len_torch_dispatch_stack() == 0
        and torch._ops._len_torch_dispatch_stack_pre_dispatch() == 0
        and not torch._C._get_tracing_state()
        and not torch._C._are_functorch_transforms_active()
    )


def current_raw_stream(device: int) -> int:
    """The current CUDA stream of ``device`` as the integer handle Triton's launch reads."""
    return torch._C._cuda_getCurrentRawStream(device)


def launch_compiled(compiled, grid: tuple[int, int, int], stream: int, args: tuple,
                    constexprs: tuple) -> None:  # fmt: skip
    """Launch Triton's ``CompiledKernel`` ``compiled`` on ``grid`` and ``stream`` through its
    own launcher (``run``), with the kernel's ``args`` then its ``constexprs``, as
    ``JITFunction.run`` passes them after binding."""
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *constexprs)  # fmt: skip


def fused_sdp_choice(q, k, v, is_causal: bool, scale: float) -> int:
    """The ``SDPBackend`` value SDPA itself picks for GQA attention of these arguments (no
    mask, no dropout)."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=True)


def mark_static_address(t: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``t`` keeps its address across calls (static cache buffers,
    as transformers' ``StaticLayer`` marks its own)."""
    torch._dynamo.mark_static_address(t)


def inductor_is_tracing() -> bool:
    """Whether inductor is tracing a graph now (it sets its fake mode around the trace).
    Imports inductor's modules: ask only where a graph may be traced."""
    from torch._inductor.virtualized import NullHandler, V

    return not isinstance(V.fake_mode, NullHandler)


def inductor_cudagraphs() -> bool:
    """Whether inductor's graphs are captured in CUDA graphs (``mode="reduce-overhead"``)."""
    from torch._inductor import config

    return config.triton.cudagraphs


def loaded_inductor_config():
    """Inductor's config module if something imported it already, else None (importing it
    costs seconds that an eager user need not pay)."""
    return sys.modules.get("torch._inductor.config")


def loaded_inductor_autotuner():
    """Inductor's ``CachingAutotuner`` class if its module is imported already, else None."""
    heuristics = sys.modules.get("torch._inductor.runtime.triton_heuristics")
    return getattr(heuristics, "CachingAutotuner", None)


@contextlib.contextmanager
def active_triton_driver(stand_in) -> Iterator[None]:
    """Within: Triton's active driver is ``stand_in`` (an offline compile's target), then the
    previous one again."""
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(stand_in)
    try:
        yield
    finally:
        driver._active = previous


def _resolves(module: str, path: str) -> bool:
    try:
        target = __import__(module, fromlist=["_"])
    except ImportError:
        return False
    for name in path.split("."):
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return True


def missing(compiling: bool = True) -> list[str]:
    """The private interfaces above that this PyTorch / Triton does not have, as
    ``module.attribute`` names (empty where every one resolves); ``compiling`` includes
    dynamo's and inductor's (importing them takes seconds)."""
    wanted = _PRIVATE + (_PRIVATE_COMPILING if compiling else ())
    wanted += _PRIVATE_CUDA if torch.version.cuda else ()
    return [f"{module}.{path}" for module, path in wanted if not _resolves(module, path)]


def require() -> None:
    """Raise ``RuntimeError`` naming every missing private interface an eager process uses
    (:func:`missing` without the compiling ones) and the versions found.

    Raises:
        RuntimeError: an interface is absent (an unsupported PyTorch or Triton release).
    """
    absent = missing(compiling=False)
    if absent:
        raise RuntimeError(
            f"tq-compile needs private interfaces that torch {torch.__version__} / triton "
            f"{triton.__version__} do not have: {', '.join(absent)}. It is tested with torch "
            "2.13 and Triton 3.6; see custom_ops/compat.py."
        )
