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
import importlib
import sys
from collections.abc import Iterator

import torch
import triton

__all__ = [
    "DisableTorchFunctionSubclass",
    "FunctionalTensorMode",
    "is_fake",
    "len_dispatch_stack",
    "len_pre_dispatch_stack",
    "jit_tracing_state",
    "functorch_transforms_active",
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
# (checked at import), dynamo's and inductor's (checked by missing(); importing them takes
# seconds that an eager process without the Hugging Face layer need not pay), and the CUDA-only
# ones (checked where torch is built with CUDA)
_PRIVATE = (
    ("torch._C", "DisableTorchFunctionSubclass"),
    ("torch._subclasses.fake_tensor", "is_fake"),
    ("torch._subclasses.functional_tensor", "FunctionalTensorMode"),
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


def _attribute(module: str, name: str):
    """``module.name``, or None where this release lacks it (:func:`require` names it)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# Bound as they are, not wrapped: the eager op path calls them on every op and launch, where a
# wrapper's frame would cost host time (~0.3 us per op).
DisableTorchFunctionSubclass = _attribute("torch._C", "DisableTorchFunctionSubclass")
is_fake = _attribute("torch._subclasses.fake_tensor", "is_fake")
FunctionalTensorMode = _attribute("torch._subclasses.functional_tensor", "FunctionalTensorMode")
# ops.is_eager's probes: the TorchDispatchMode stack (fake tensors, functionalization, a recorder
# of ops), make_fx's pre-dispatch modes, a torch.jit trace, functorch transforms (vmap, grad)
len_dispatch_stack = _attribute("torch._C", "_len_torch_dispatch_stack")
len_pre_dispatch_stack = _attribute("torch._ops", "_len_torch_dispatch_stack_pre_dispatch")
jit_tracing_state = _attribute("torch._C", "_get_tracing_state")
functorch_transforms_active = _attribute("torch._C", "_are_functorch_transforms_active")
# the current CUDA stream of a device as the integer handle Triton's launch reads (CUDA builds)
current_raw_stream = _attribute("torch._C", "_cuda_getCurrentRawStream")


def launch_compiled(
    compiled, grid_0: int, grid_1: int, grid_2: int, stream: int, args: tuple, constexprs: tuple
) -> None:
    """Launch Triton's ``CompiledKernel`` ``compiled`` on the grid and ``stream`` through its
    own launcher (``run``), with the kernel's ``args`` then its ``constexprs``, as
    ``JITFunction.run`` passes them after binding (its ``run``, ``function`` and
    ``packed_metadata`` exist only on a compiled kernel: tests launch through here on a GPU)."""
    compiled.run(
        grid_0,
        grid_1,
        grid_2,
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *constexprs,
    )


def fused_sdp_choice(q, k, v, is_causal: bool, scale: float) -> int:
    """The ``SDPBackend`` value SDPA itself picks for GQA attention of these arguments (no
    mask, no dropout)."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=True)


def mark_static_address(t: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``t`` keeps its address across calls (static cache buffers,
    as transformers' ``StaticLayer`` marks its own)."""
    torch._dynamo.mark_static_address(t)


def has_static_address(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked with :func:`mark_static_address` (or by transformers)."""
    return torch._dynamo.utils.get_static_address_type(t) is not None


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
    """Whether ``module`` imports and has the dotted attribute ``path``."""
    try:
        target = importlib.import_module(module)
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
