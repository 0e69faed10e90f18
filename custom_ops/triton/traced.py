"""Launches that inductor performs itself: the ``tq`` ops' kernels inside compiled graphs.

Called while ``torch.compile`` traces a graph (see :func:`custom_ops.ops.inductor_launches`),
an op's CUDA implementation runs with fake tensors and its launches go through
``torch.library.wrap_triton``: they become ``triton_kernel_wrapper`` nodes of the graph, and
inductor's generated code launches the kernels directly, with no op call and no Python of ours
per step (what an eager or extern call of an op costs: ``docs/design/host-path.md``).

Inductor takes a kernel's arguments one by one: a tuple argument (the kernels take the cache
as ``planes``, ``table``, ``rings``... tuples, see :mod:`custom_ops.triton.paged`) is silently
dropped. So each kernel is launched here through a *flat entry*: a generated ``@triton.jit``
kernel whose parameters are the kernel's runtime arguments with every tuple spread into its
items, which rebuilds the tuples and calls the kernel (Triton inlines it: the same program).
Its integer parameters (shapes, strides, counts, which the graph's static shapes fix) are
constexprs, compiled in: inductor's static launch converts every runtime argument at every
launch (store_window 42 -> 12 runtime arguments, split 38 -> 15;
``docs/design/host-path.md#integers-compiled-in``).
Launch options travel in a one-config ``triton.autotune`` (``wrap_triton`` takes no
``maxnreg``); programmatic dependent launch is not available to inductor's launches, so the
kernels are traced with their ``PDL`` constexpr off.

Inductor compiles a user kernel with its config's ``num_warps`` and ``num_stages`` but drops
its ``maxnreg`` (PyTorch 2.11 and 2.13: ``CachingAutotuner._create_compile_options`` copies
neither it nor ``num_ctas``): the long-split decode compiled at 157-166 registers instead of
its cap of 128, 16% (4bit_nc) to 35% (k8v4) slower alone at 16 x 32768, and 9% of 4bit_nc's
split time in the 1b-shape model's plain-compiled step
(``docs/design/host-path.md#register-caps``). Every process that loads such a kernel to compile
it mends that first (:func:`honour_register_caps`, called
by :func:`rebuilt`; the capped kernel, the split kernel, has NamedTuple constexprs).

Inductor launches such user-defined kernels with Triton's Python launcher unless
``torch._inductor.config.static_launch_user_defined_triton_kernels`` is on; importing
:mod:`custom_ops` turns it on (:func:`static_launch_by_default`): its static CUDA launcher took
the 1b-shape model's plain-compiled step at B=1 from 0.74x to 1.13x of bf16
(``docs/design/host-path.md#the-static-launcher``).

Inductor writes the constexprs into its generated module as their ``repr``; the NamedTuple
constexprs (:class:`~custom_ops.triton.planes.CodecParams`,
:class:`~custom_ops.triton.decode.codes.PartParams`) therefore print as a call of
:func:`rebuilt` (:func:`importable_repr`), which every process evaluates before compiling the
kernel: the compile workers, and the parent when it compiles itself (its pool not ready yet, a
cache hit that skipped the trace).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import linecache
import math
import os

import torch
import triton
import triton.language as tl

from custom_ops import compat
from custom_ops.thread_flag import ThreadFlag

__all__ = [
    "traced_launches",
    "tracing",
    "unread",
    "launch_traced",
    "importable_repr",
    "rebuilt",
    "STATIC_LAUNCH_ENV",
    "static_launch_by_default",
    "honour_register_caps",
]

# Inductor's switch for launching user-defined Triton kernels through its static CUDA launcher
# (a C++ launch with the arguments packed once) instead of Triton's Python launcher; read from
# the environment by every compile worker (where inductor decides how a kernel is launched),
# and as its config's forced value.
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def static_launch_by_default() -> None:
    """Have inductor launch user-defined Triton kernels (the tq kernels it launches itself,
    and any other) through its static CUDA launcher, unless :data:`STATIC_LAUNCH_ENV` is set
    already: set it to ``0`` before importing :mod:`custom_ops` to keep Triton's launcher (once
    the variable is set, it overrides inductor's config switch of that name, ``config.patch``
    included). Kernels the static launcher cannot take fall back to Triton's.

    Done at import, not when a graph is traced: inductor starts its compile workers, which read
    the variable when they start, before it traces."""
    if os.environ.setdefault(STATIC_LAUNCH_ENV, "1") != "1":
        return
    config = compat.loaded_inductor_config()
    # imported before the variable was set, it did not read it (a torch without the switch
    # has no static launcher for user kernels: nothing to do)
    if config is not None and hasattr(config, "static_launch_user_defined_triton_kernels"):
        config.static_launch_user_defined_triton_kernels = True


def honour_register_caps() -> None:
    """Have inductor compile a kernel whose config sets ``maxnreg`` (a traced launch's register
    cap, :func:`_configured`) under that cap: wraps ``CachingAutotuner._create_compile_options``,
    which makes a config's ``triton.compile`` options and leaves the cap out, so that the cap
    reaches them (a cap the options already hold is kept: a PyTorch that passes it is left as it
    is). Configs without a cap, all of inductor's own kernels', compile as before.

    Does nothing until inductor's ``triton_heuristics`` module is imported (importing it costs
    ~2 s: not done for an eager user), or where it has no such method. :func:`rebuilt` calls it
    where inductor loads a kernel of ours, after that import."""
    autotuner = compat.loaded_inductor_autotuner()
    options_without_cap = getattr(autotuner, "_create_compile_options", None)
    if options_without_cap is None or getattr(options_without_cap, "honours_register_caps", False):
        return

    @functools.wraps(options_without_cap)
    def create_compile_options(self, cfg, *args, **kwargs) -> dict:
        options = options_without_cap(self, cfg, *args, **kwargs)
        if getattr(cfg, "maxnreg", None) is not None and self.device_props.type == "cuda":
            options.setdefault("maxnreg", cfg.maxnreg)
        return options

    create_compile_options.honours_register_caps = True
    autotuner._create_compile_options = create_compile_options


# The launch options a Launcher's kwargs may hold besides the kernel's constexprs: the ones an
# inductor launch takes (in its config), and programmatic dependent launch, which it has not.
CONFIG_OPTIONS = ("num_warps", "num_stages", "maxnreg")
PDL_OPTION = "launch_pdl"

_TRACING = ThreadFlag()


def traced_launches() -> contextlib.AbstractContextManager[None]:
    """Within: every :class:`~custom_ops.triton.launch.Launcher` launch is traced into the graph
    being built (``wrap_triton``) instead of run."""
    return _TRACING.set()


def tracing() -> bool:
    """Whether launches are being traced (inside :func:`traced_launches`)."""
    return _TRACING.on


def unread(like: torch.Tensor) -> torch.Tensor:
    """What to pass for a kernel argument the launch never reads: ``like`` itself (nothing
    allocated), or while launches are traced, an empty tensor of its dtype and device. Where
    the mutation analysis of a traced launch fails (PyTorch 2.11 stops at inline PTX), every
    argument counts as written, and a tensor passed twice is then copied first."""
    return like.new_empty(0) if tracing() else like


def importable_repr(value: tuple) -> str:
    """``repr`` of a NamedTuple constexpr that evaluates anywhere, to an equal tuple: a call of
    :func:`rebuilt` reached through ``__import__`` (inductor's generated module has none of our
    names), without a backslash (inductor embeds the kernel's module, constexprs included, in a
    string literal, which would turn the escaped line breaks of an inline-PTX string into real
    ones)."""
    cls = type(value)
    fields = "".join(
        f", {name}={_literal(item)}" for name, item in zip(cls._fields, value, strict=True)
    )
    return (
        f"__import__({__name__!r}, fromlist=['rebuilt'])."
        f"rebuilt({cls.__module__!r}, {cls.__name__!r}{fields})"
    )


def rebuilt(module: str, name: str, /, **fields) -> tuple:
    """The NamedTuple ``module.name(**fields)``, as inductor's generated code rebuilds a
    constexpr (:func:`importable_repr`). Whichever process evaluates a kernel's constexprs is
    about to compile it (a compile worker, or the parent, on a cache hit too) and has imported
    inductor's autotuner module: :func:`honour_register_caps` first, so that the kernel keeps
    its register cap."""
    honour_register_caps()
    return getattr(importlib.import_module(module), name)(**fields)


def _literal(value) -> str:
    """A Python expression for ``value`` (numbers, strings, tuples of them) with no
    backslash: strings as their UTF-8 bytes in hex."""
    if isinstance(value, str):
        return f"bytes.fromhex('{value.encode().hex()}').decode()"
    if isinstance(value, tuple):
        return f"({''.join(f'{_literal(item)}, ' for item in value)})"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


def _structure(args: tuple) -> tuple:
    """The tuple structure of ``args``: per argument, the structure of its items (a tuple),
    ``float`` (a Python float), ``int`` (a Python int) or None (any other single value)."""
    return tuple(
        _structure(arg)
        if isinstance(arg, tuple)
        else next((t for t in (float, int) if isinstance(arg, t)), None)
        for arg in args
    )


def _flatten(args: tuple) -> list:
    flat = []
    for arg in args:
        if isinstance(arg, tuple):
            flat += _flatten(arg)
        else:
            flat.append(arg)
    return flat


def _spread(names: list[str], structure: tuple) -> tuple[list[str], list[str]]:
    """``(parameters, call arguments)``: the flat parameter names of arguments ``names`` of
    ``structure`` in :func:`_flatten`'s order, and the expressions that rebuild each argument
    from them."""
    params, rebuilt = [], []
    for name, inner in zip(names, structure, strict=True):
        if inner is None or inner is int:
            params.append(name)
            rebuilt.append(name)
        elif inner is float:
            # Triton types a Python float fp32, inductor's launch fp64: the kernel's fp32
            params.append(name)
            rebuilt.append(f"tl.cast({name}, tl.float32)")
        else:
            inner_params, inner_rebuilt = _spread(
                [f"{name}_{i}" for i in range(len(inner))], inner
            )
            params += inner_params
            rebuilt.append(f"({', '.join(inner_rebuilt)},)")
    return params, rebuilt


@functools.cache
def _flat_entry(kernel, structure: tuple):
    """The flat entry of ``kernel`` (a ``@triton.jit`` kernel) for runtime arguments of tuple
    ``structure`` (:func:`_structure`), and the names of its integer parameters: a jit kernel
    taking the flattened arguments (the integers among them as constexprs, by those names),
    then the kernel's constexprs by name, that calls ``kernel`` with the tuples rebuilt. Built
    once per kernel and structure, named after both (the same name in every process); its
    source lives in ``linecache`` (Triton and inductor read it)."""
    # an interpreted kernel has no parameter list of its own: Triton's parse of its function
    kernel_params = getattr(kernel, "params", None) or triton.JITFunction(kernel.fn).params
    runtime = [p.name for p in kernel_params if not p.is_constexpr]
    constexprs = [p.name for p in kernel_params if p.is_constexpr]
    flat, rebuilt = _spread(runtime, structure)
    # Integers (shapes, strides, counts) are constants of a compiled graph, whose static
    # shapes fixed them; as constexprs they are compiled in instead of passed at every launch
    # (a static launch's host time grows with its arguments).
    ints = [leaf is int for leaf in _flatten(structure)]  # the structure's leaves, in order
    params = [p for p, is_int in zip(flat, ints, strict=True) if not is_int]
    int_params = [p for p, is_int in zip(flat, ints, strict=True) if is_int]
    fixed = int_params + constexprs
    name = f"{kernel.__name__}_flat_{hashlib.sha1(repr(structure).encode()).hexdigest()[:8]}"
    source = (
        f"def {name}({', '.join(params + [f'{c}: tl.constexpr' for c in fixed])}):\n"
        f"    {kernel.__name__}({', '.join(rebuilt + [f'{c}={c}' for c in constexprs])})\n"
    )
    filename = f"<tq flat entry {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"tl": tl, "triton": triton, kernel.__name__: kernel}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (generated above)
    # Alignment is inductor's to specialize (it knows its buffers); Triton's own specializing
    # of fake tensors' alignment, in the mutation analysis of the traced launch, would read
    # their data pointers and fail, and then every argument would count as written.
    return triton.jit(namespace[name], do_not_specialize_on_alignment=params), int_params


def launch_traced(kernel, kwargs: dict, grid: tuple[int, ...], args: tuple) -> None:
    """Trace ``kernel[grid](*args, **kwargs)`` into the graph being built: its flat entry, one
    autotune config holding the launch options. A ``PDL`` constexpr goes off: inductor's
    launches have no programmatic dependent launch, and the waits it compiles in are inline
    PTX that the mutation analysis of the launch cannot see through (not pure), so with it every
    argument would count as written."""
    options = {k: kwargs[k] for k in CONFIG_OPTIONS if k in kwargs}
    constexprs = {k: v for k, v in kwargs.items() if k not in (*CONFIG_OPTIONS, PDL_OPTION)}
    if "PDL" in constexprs:
        constexprs["PDL"] = False
    structure = _structure(args)
    entry, int_params = _flat_entry(kernel, structure)
    flat, ints = _flatten(args), [leaf is int for leaf in _flatten(structure)]
    constexprs.update(
        zip(int_params, [v for v, i in zip(flat, ints, strict=True) if i], strict=True)
    )
    runtime = [v for v, is_int in zip(flat, ints, strict=True) if not is_int]
    torch.library.wrap_triton(_configured(entry, tuple(sorted(options.items()))))[grid](
        *runtime, **constexprs
    )


@functools.cache
def _configured(entry, options: tuple):
    """``entry`` under a one-config ``triton.autotune`` with launch ``options``. The register
    cap goes in the config's keyword arguments: inductor writes a user kernel's configs into
    its code as the keyword arguments, ``num_warps`` and ``num_stages`` (a ``maxnreg`` option
    would be lost), and reads ``maxnreg`` back from there into the config; from the config to
    the compile only :func:`honour_register_caps` takes it."""
    options = dict(options)
    registers = {"maxnreg": options.pop("maxnreg")} if "maxnreg" in options else {}
    return triton.autotune(configs=[triton.Config(registers, **options)], key=[])(entry)
