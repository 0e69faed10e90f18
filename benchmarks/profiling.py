"""Where a decode step's GPU time goes, kernel by kernel: ``torch.profiler``'s CUDA events of a
few profiled steps turned into a per-kernel table, the GPU's idle time before each launch, and
the kernels per layer of the cache's attention work. Shared by ``e2e.py`` and
``hf_generate.py`` (``--kernels N``).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import torch
import triton

import custom_ops.triton

__all__ = [
    "STEP_PAUSE_US",
    "SDPA_KERNEL_MARKS",
    "idle_before",
    "step_timeline",
    "kernel_table",
    "tq_kernel_names",
    "attention_kernels",
]

# the GPU is idle between two steps' kernels for as long as the host takes: longer idle time
# than this is not a gap inside the step's work (a graph replay's gaps are ~0.1-1 us)
STEP_PAUSE_US = 50.0
# dense SDPA's kernels (cuDNN's attention and its split reduction, flash, memory-efficient)
SDPA_KERNEL_MARKS = ("sdpa", "cudnn", "flash", "fmha", "attention")


def idle_before(launches: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """Each launch ``(name, start, end)`` (microseconds, one stream's kernels) with the time the
    GPU ran none of them just before it started: its start minus the latest end of the
    launches that started before it, 0 where it overlapped one (programmatic dependent launch),
    and 0 after a pause longer than :data:`STEP_PAUSE_US` (between steps). Summed per kernel,
    this is where a step's time goes between kernels: launch latency, a dependency's wait. Made
    for CUDA-graph replays: in eager and default modes the host's gaps inside a step may pass
    the pause and count as 0."""
    rows, busy_until = [], None
    for name, begin, end in sorted(launches, key=lambda launch: launch[1]):
        idle = 0.0 if busy_until is None else max(0.0, begin - busy_until)
        rows.append((name, begin, end, idle if idle <= STEP_PAUSE_US else 0.0))
        busy_until = end if busy_until is None else max(busy_until, end)
    return rows


def step_timeline(timed: list[tuple[str, float, float, float]], count: int) -> list[dict]:
    """The last ``count`` launches of :func:`idle_before`'s list (one step's, every step
    launching as many), in order: name, start (microseconds from the first), duration and idle
    time before it."""
    last = timed[len(timed) - count :]
    return [
        dict(kernel=name, start_us=begin - last[0][1], us=end - begin, idle_us=idle)
        for name, begin, end, idle in last
    ]


def kernel_table(prof: torch.profiler.profile, steps: int) -> tuple[list[dict], list[dict]]:
    """The GPU work of a finished profile of ``steps`` steps.

    Args:
        prof: a ``torch.profiler.profile`` with CUDA activity, stopped.
        steps: the steps it covered.

    Returns:
        Per kernel (by name, summed over its launches; memory copies and sets too), largest
        first: ``us``, ``launches`` and ``idle_us`` (:func:`idle_before`) per step; and the last
        step's launches (:func:`step_timeline`).
    """
    launches = [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0
    ]
    timed = idle_before(launches)
    totals: dict[str, list] = {}
    for name, begin, end, idle in timed:
        entry = totals.setdefault(name, [0.0, 0, 0.0])
        entry[0] += end - begin
        entry[1] += 1
        entry[2] += idle
    rows = [
        dict(kernel=name, us=us / steps, launches=count / steps, idle_us=idle / steps)
        for name, (us, count, idle) in totals.items()
    ]
    return sorted(rows, key=lambda r: -r["us"]), step_timeline(timed, len(timed) // steps)


@functools.cache
def tq_kernel_names() -> frozenset[str]:
    """The names of the Triton kernels the ``tq`` ops launch (every ``*_kernel`` jit function
    of :mod:`custom_ops.triton`; a traced launch's flat entry is named after its kernel)."""
    package = custom_ops.triton
    names = set()
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for value in vars(importlib.import_module(module.name)).values():
            # (KernelInterface: a jit function, or its interpreted form under TRITON_INTERPRET)
            if isinstance(value, triton.runtime.KernelInterface):
                name = getattr(value, "__name__", "")
                if name.endswith("_kernel"):
                    names.add(name)
    return frozenset(names)


def attention_kernels(kernels: list[dict], dense: bool, n_layer: int) -> float:
    """Kernels per layer per step of a cell's attention work (:func:`kernel_table`'s rows): the
    ``tq`` ops' kernels for a TurboQuant cache, dense SDPA's for a ``dense`` one."""

    def counted(name: str) -> bool:
        if dense:  # (inductor's own kernels, triton_*, may be named after SDPA)
            marked = any(mark in name.lower() for mark in SDPA_KERNEL_MARKS)
            return marked and not name.startswith("triton_")
        return name.split("_flat_")[0] in tq_kernel_names()

    return sum(r["launches"] for r in kernels if counted(r["kernel"])) / n_layer
