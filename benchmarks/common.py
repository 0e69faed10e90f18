"""Helpers shared by the benchmark scripts: timing, the copy-bandwidth yardstick, output.

Benchmarks are plain scripts (``python benchmarks/<name>.py``), not tests. Each one times its
kernels with :func:`bench`, relates achieved bandwidth to :func:`copy_bandwidth` measured in the
same run (so results from different GPUs compare as fractions of what the memory can do),
prints a table with :func:`print_table` and saves the numbers with :func:`write_json`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import triton.testing

__all__ = [
    "RESULTS_DIR",
    "require_cuda",
    "gpu_name",
    "copy_bandwidth",
    "capture",
    "bench",
    "print_table",
    "write_json",
    "pyplot",
    "save_figure",
    "time_in_process",
    "report_cell",
    "kv_cache_bytes",
    "largest_batch",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def require_cuda(script: str) -> None:
    """Exit with a clear message (status 1) when no CUDA device is available."""
    if not torch.cuda.is_available():
        sys.exit(
            f"{script}: needs a CUDA GPU and a CUDA build of torch "
            f"(torch {torch.__version__} sees no CUDA device)"
        )


def gpu_name(device: torch.device | str = "cuda") -> str:
    """The name of the CUDA device, e.g. ``NVIDIA H100 80GB HBM3``."""
    return torch.cuda.get_device_name(torch.device(device))


def copy_bandwidth(
    device: torch.device | str = "cuda", nbytes: int = 2 << 30, reps: int = 50
) -> float:
    """Device-to-device copy bandwidth in bytes per second.

    Copies an ``nbytes`` buffer (2 GiB: far larger than any L2) into another one ``reps``
    times, timing each copy with CUDA events, and counts the bytes read plus the bytes written
    (``2 * nbytes``) over the median time.
    """
    device = torch.device(device)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):  # warm up
        dst.copy_(src)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize(device)
    median_ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (median_ms * 1e-3)


def capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn``, after three warm-up calls on a side stream (kernel
    compilation, allocator warm-up); ``fn`` must be capturable (no host syncs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench(
    fn: Callable[[], Any], *, warmup_ms: int = 25, rep_ms: int = 100, cuda_graph: bool = False
) -> float:
    """Median time of one call of ``fn`` in microseconds, with L2 flushed before every call.

    Times with :func:`triton.testing.do_bench` (CUDA events around each call; a 256 MB buffer
    zeroed before each call, so a working set that would fit in L2 is still read from memory).
    Eager calls also count whatever host overhead (Python, op dispatch, launches) the GPU does
    not hide behind that flush. With ``cuda_graph=True``, ``fn`` is first captured into a CUDA
    graph and each call replays it, which leaves only the GPU's own time; ``fn`` must then be
    capturable (no host syncs) and is run a few times on a side stream before capture.
    """
    run = capture(fn).replay if cuda_graph else fn
    ms = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms * 1e3


def print_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> None:
    """Print ``rows`` as an aligned text table.

    Args:
        rows: one mapping per row, from column key to value.
        columns: column key -> format spec of its values (``""`` for ``str()``, ``".1f"``...);
            the key is the header. Text is left-aligned, numbers right-aligned.
    """
    cells = [[format(row[key], spec) for key, spec in columns.items()] for row in rows]
    numeric = [all(isinstance(row[key], int | float) for row in rows) for key in columns]
    widths = [max(len(key), *(len(line[i]) for line in cells)) for i, key in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(list(columns)))
    print(line(["-" * w for w in widths]))
    for values in cells:
        print(line(values))


def write_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as JSON to ``benchmarks/results/<path>`` (created if missing).

    Returns:
        The path written.
    """
    out = RESULTS_DIR / path
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def write_results(
    path: str | Path, payload: Any, plot: Callable[[Any, Path], None] | None, replot: str = ""
) -> Path:
    """Write ``payload`` as JSON (:func:`write_json`), print where, and draw its PNG beside it
    with ``plot(payload, png_path)`` where ``plot`` is given; matplotlib is optional, so
    without it say that there is no PNG (and ``replot``, the command that draws it later).

    Returns:
        The JSON's path.
    """
    out = write_json(path, payload)
    print(f"wrote {out}")
    if plot is not None:
        try:
            plot(payload, out.with_suffix(".png"))
        except ImportError:
            print(f"matplotlib not installed: no PNG{f' ({replot})' if replot else ''}")
    return out


def pyplot():
    """matplotlib's ``pyplot`` on the file-only Agg backend, imported when a plot is drawn
    (matplotlib is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> None:
    """Lay ``fig`` out, write it to ``path`` at 120 dpi and print where."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# The line a cell's own process prints its result on (time_in_process, report_cell).
CELL_RESULT = "benchmark cell result: "


def time_in_process(script: str | Path, cell: dict, timeout_s: float) -> dict:
    """Run ``python script --cell JSON(cell)`` in a new process and return the result it
    printed with :func:`report_cell`; ``{"error": ...}`` where it printed none (killed, crashed)
    or took longer than ``timeout_s``. Its stderr passes through.

    CUDA-graph cells are timed this way: a graph captured after another one in the same process
    waits ~0.45 us before each kernel instead of ~0.1 us on an H200 (docs/notes/
    2026-11-29-first-graph.md), which would favour whichever cell comes first."""
    try:
        child = subprocess.run(
            [sys.executable, str(script), "--cell", json.dumps(cell)],
            stdout=subprocess.PIPE,
            text=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return dict(error=f"no result in {timeout_s} s")
    for line in reversed(child.stdout.splitlines()):
        if line.startswith(CELL_RESULT):
            return json.loads(line[len(CELL_RESULT) :])
    print(f"cell {cell}: exit code {child.returncode}, no result:\n{child.stdout}", flush=True)
    return dict(error=f"exit code {child.returncode}")


def report_cell(result: dict) -> None:
    """Print a cell's result for the :func:`time_in_process` that started this process."""
    print(CELL_RESULT + json.dumps(result), flush=True)


def kv_cache_bytes(
    preset: str | None,
    n_layer: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int,
    context: int,
    **options,
) -> int:
    """Bytes of a KV cache, counted on the meta device without allocating it.

    Args:
        preset: a TurboQuant format name, or None for bf16 keys and values.
        n_layer, num_kv_heads, head_dim: the model's layers, kv-heads and head dim.
        batch, context: sequences and slots per sequence.
        options: the ``TurboQuantKVCache``'s options (window, sinks, center_keys; the Hugging
            Face cache's layers hold the same).

    Returns:
        The bytes every layer's cache holds together.
    """
    if preset is None:
        return 2 * n_layer * batch * num_kv_heads * context * head_dim * 2
    from tq_compile import TurboQuantKVCache

    layer = TurboQuantKVCache(
        batch,
        num_kv_heads,
        context,
        head_dim,
        preset=preset,
        device="meta",
        warn_unquantized=False,
        **options,
    )
    return n_layer * layer.nbytes()


def largest_batch(kv_bytes: Callable[[int], int], budget_bytes: float) -> int:
    """The most sequences whose KV cache fits a budget.

    Args:
        kv_bytes: the cache's bytes at a batch (affine in it).
        budget_bytes: the budget.

    Returns:
        The largest batch with ``kv_bytes(batch) <= budget_bytes``, 0 where not even one
        sequence fits.
    """
    one = kv_bytes(1)
    if one > budget_bytes:
        return 0
    # affine in the batch: a TurboQuant cache also holds its constants (rotation, levels)
    batch = 1 + int((budget_bytes - one) // (kv_bytes(2) - one))
    while batch > 1 and kv_bytes(batch) > budget_bytes:
        batch -= 1
    return batch
