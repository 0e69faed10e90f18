"""Launching a kernel through its compiled handle: the host path of every ``tq`` op on CUDA.

``kernel[grid](*args, **kwargs)`` (``JITFunction.run``) binds and specializes every argument,
builds the compilation key and looks the kernel up on each call: tens of microseconds for the
decode kernels' dozens of arguments, which is most of an eager decode step's host time. A
:class:`Launcher` makes that call once per *specialization* of the arguments (the tensors'
dtypes and 16-byte alignment, the integers' values) and then calls the compiled kernel's own
launcher directly, with the same arguments. The ops give it their arguments' metadata key
(:func:`custom_ops.validate.launch_key`), which determines every specialization of the
arguments they derive from them, so a launch does not even look at its arguments. Under
Triton's interpreter, or while a launch hook (a profiler) is installed, it always takes the
ordinary path; while a graph is traced for inductor (:mod:`custom_ops.triton.traced`), it traces
the launch into the graph instead.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from triton import knobs

from custom_ops import compat
from custom_ops.triton import traced

__all__ = ["Launcher", "KernelLaunch", "KeyedMemo"]


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton's hooks are chains, empty by default)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _signature(args: tuple) -> tuple:
    """What Triton specializes a kernel on, for the arguments ``args`` (tuples flattened):
    a tensor's dtype and 16-byte alignment, an integer's value; other values not at all."""
    key = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, tuple):
            key.append(_signature(arg))
        elif isinstance(arg, int):  # bool included
            key.append(arg)
        else:
            key.append(None)
    return tuple(key)


class Launcher:
    """One kernel with fixed compile-time arguments, launched by its compiled handle.

    Args:
        kernel: the ``@triton.jit`` kernel.
        kwargs: its constexpr arguments and launch options (``num_warps``, ``maxnreg``,
            ``launch_pdl``...), the same for every launch through this object.
    """

    def __init__(self, kernel, kwargs: dict):
        self.kernel, self.kwargs = kernel, kwargs
        self._compiled = KeyedMemo()  # compiled kernels by (device, specialization key)
        params = getattr(kernel, "params", None)  # None: an interpreted kernel
        if params is not None:
            # the constexpr values in parameter order, after the positional runtime arguments
            self._constexprs = [kwargs[p.name] for p in params if p.name in kwargs]
            if len(self._constexprs) != sum(p.is_constexpr for p in params):
                raise TypeError(f"{kernel.__name__}: every constexpr must be given")

    def __call__(self, grid: tuple[int, ...], *args, key: Hashable | None = None) -> None:
        """Launch on ``grid`` with the runtime arguments ``args`` (positional, in order).

        ``key``: a hashable that determines Triton's specialization of ``args`` (the metadata
        key of the op's arguments that ``args`` are derived from), or None to compute it from
        ``args``."""
        if key is not None and not _hooked():
            # the eager op call's path, checked first: a keyed launch has plain CUDA tensors
            # (launches being traced and interpreted ones have no key)
            device = torch.cuda.current_device()
            compiled = self._compiled.peek((device, key))
            if compiled is not None:
                self._run(compiled, device, grid, args)
                return
        if traced.tracing():
            traced.launch_traced(self.kernel, self.kwargs, grid, args)
            return
        if knobs.runtime.interpret or _hooked():
            self.kernel[grid](*args, **self.kwargs)
            return
        device = torch.cuda.current_device()
        key = (device, _signature(args) if key is None else key)
        compiled = self._compiled.peek(key)
        if compiled is None:  # compiles, or finds the kernel in Triton's cache, and launches
            self._compiled.put(key, self.kernel[grid](*args, **self.kwargs))
            return
        self._run(compiled, device, grid, args)

    def _run(self, compiled, device: int, grid: tuple[int, ...], args: tuple) -> None:
        """Launch the compiled kernel ``compiled`` on ``device`` through its own launcher."""
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        stream = compat.current_raw_stream(device)  # what Triton's own launch reads
        compat.launch_compiled(compiled, grid[0], grid_1, grid_2, stream, args, self._constexprs)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel's launch in a plan: its grid and a :class:`Launcher` holding its constexprs
    and launch options; calling it launches with the runtime arguments."""

    grid: tuple[int, ...]
    launcher: Launcher = field(compare=False)

    @property
    def kwargs(self) -> dict:
        """The constexprs and launch options (read-only)."""
        return self.launcher.kwargs

    def __call__(self, *args, key: Hashable | None = None) -> None:
        self.launcher(self.grid, *args, key=key)


class KeyedMemo:
    """Values computed once per launch key (an op's launch plan, its launcher and grid, a
    launcher's compiled kernels), so a call with known metadata does no host-side policy work;
    bounded, since every new shape (a prefill's length) adds a key."""

    def __init__(self, bound: int = 4096):
        self._values: dict = {}
        self._bound = bound

    def peek(self, key: tuple):
        """The value remembered for ``key``, or None."""
        return self._values.get(key)

    def put(self, key: tuple, value) -> None:
        """Remember ``value`` for ``key`` (everything is forgotten at the bound)."""
        if len(self._values) >= self._bound:
            self._values.clear()
        self._values[key] = value

    def get(self, key: Hashable | None, make):
        """The value remembered for ``key``, or ``make()`` (remembered unless ``key`` is None:
        arguments without a key, such as interpreted or value-checked calls)."""
        if key is None:
            return make()
        value = self._values.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value
