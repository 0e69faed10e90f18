"""End-to-end decode speed of the example model: TurboQuant caches vs the best bf16 model.

The example model (``examples/model.py``, random weights, default the ~1B ``1b-shape``: 16
layers, Hq=32, Hk=8, D=128) decodes one token per sequence per step with caches of ``context``
slots per sequence holding ``context - steps - 4`` random tokens, so the timed steps attend to
about ``context`` tokens. Caches:

* ``bf16``: the dense cache with ``F.scaled_dot_product_attention(..., enable_gqa=True)``, what a
  careful user writes: the baseline of every speed-up;
* ``bf16-repeat``: the same cache with gpt-fast's ``repeat_interleave`` of K/V to all query heads
  (a 4x copy of the cache per layer and step), for reference;
* each TurboQuant format, with its default 128-token bf16 window.

Modes: ``reduce-overhead`` (``torch.compile(decode_one_token, mode="reduce-overhead",
fullgraph=True)``: CUDA graphs), ``default`` (``torch.compile(..., fullgraph=True)``, no
graphs: host-bound at small batch) and ``eager``. Each ``reduce-overhead`` cell runs in a fresh
process (``--one-process``: all in this one), because a CUDA graph captured after another one
in the same process runs slower: on an H200 the GPU waits ~0.45 us between two of its kernels
instead of ~0.1 (the step's 250 kernels lose ~90 us), however the earlier graph was freed, so
the first cell of a run would be favoured. Each cell times ``--steps`` steps after
warm-up in five blocks, wall clock between two synchronizations, and reports the median block
(the JSON has every block's); in eager mode the caches of one batch and context are all held
at once and their blocks interleaved, so that a slow stretch of a shared host slows a block of
each rather than one cache's whole cell. A cache that does not fit the GPU is reported as
``oom`` (a capacity win for the smaller cache). ``max_context``: the longest context per
sequence whose KV cache fits ``--kv-budget-gb`` at that batch.

``--capacity-gb GB`` times what a serving user buys instead: each cache at the largest batch
whose KV cache fits ``GB`` (bf16 included, at its own batch), and ``speedup`` is tokens per
second over bf16's:

    python benchmarks/e2e.py --modes reduce-overhead --contexts 8192 --capacity-gb 24 \
        --formats k8v4 4bit_nc 3bit_nc tqk5v3_nc --dense

The table's ``splits`` is each TurboQuant cache's decode split count (``--splits N`` forces one):
at the large batches of a capacity run it decides how much of the GPU the decode fills.

``--kernels N`` adds, per cell, the GPU time per step of every kernel over ``N`` profiled steps
(``torch.profiler``; kernels replayed from a CUDA graph included), the largest first: where the
step's time goes, with ``idle_us``, the time the GPU ran nothing just before that kernel's
launches (launch latency, a dependency's wait; the JSON has the last step's launches in order,
``timeline``); and the table's ``attn_kernels``: kernels per layer per step of the cache's
attention work, the ``tq`` ops' Triton kernels (append, query preparation, split, ring, merge)
for a TurboQuant cache, SDPA's for bf16 (whose cache write inductor fuses into the RoPE kernel).

``--host`` adds the host-overhead table: CPU microseconds per eager call of one layer's cache
write and attention (dense ``KVCache.update`` and SDPA; ``TurboQuantKVCache.update``, SDPA
through the ``TurboQuantKVTensor``, and the raw ``tq.decode`` / ``tq.store_window``), and the
GPU time of a one-token append (``tq.store_window``) from CUDA-graph replays.

    python benchmarks/e2e.py --batches 1 --contexts 4096 --modes eager     # one cell
    python benchmarks/e2e.py --host --modes                                # host table only
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import (  # noqa: E402
    capture,
    gpu_name,
    kv_cache_bytes,
    largest_batch,
    print_table,
    pyplot,
    report_cell,
    require_cuda,
    save_figure,
    time_in_process,
    write_results,
)
from profiling import attention_kernels, kernel_table  # noqa: E402

from custom_ops.formats import PagedKVCache, RecentWindow, get_format  # noqa: E402
from custom_ops.triton import store_window as triton_store_window  # noqa: E402
from examples.generate import sync  # noqa: E402
from examples.model import (  # noqa: E402
    KVCache,
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,  # noqa: E402
)
from tq_compile import TurboQuantKVCache, kv_cache_nbytes  # noqa: E402

FILL_CHUNK = 2048
BASELINE = "bf16"
DENSE = {"bf16": "enable_gqa", "bf16-repeat": "repeat_interleave"}
MODES = ("reduce-overhead", "default", "eager")
BLOCKS = 5  # timed blocks of consecutive steps per cell (time_decode)


@torch.no_grad()
def fill_caches(model: Transformer, batch: int, context: int, gen: torch.Generator) -> None:
    """Put ``context`` random tokens in every layer's cache (what a prefill would leave);
    ``gen`` is on the model's device."""
    cfg, device = model.config, model.output.weight.device
    for layer in model.layers:
        cache = layer.attention.kv_cache
        for start in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - start)
            shape = (batch, cfg.n_local_heads, n, cfg.head_dim)
            k = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
            v = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
            cache.update(torch.arange(start, start + n, device=device), k, v)


def step_function(mode: str):
    """The decode step as a user runs it in ``mode``."""
    if mode == "eager":
        return decode_one_token
    torch._dynamo.reset()
    options = {"mode": "reduce-overhead"} if mode == "reduce-overhead" else {}
    return torch.compile(decode_one_token, fullgraph=True, **options)


@torch.no_grad()
def time_decode(
    model: Transformer, step, batch: int, position: int, steps: int, installs: dict | None = None
):
    """Milliseconds per decode step at positions ``position, position + 1, ...`` (on the
    model's device: the CPU too, for benchmarks/tp.py's gloo runs), and per block: the median
    over blocks of consecutive steps (:data:`BLOCKS`, or one per step if fewer), so that a
    pause of the host in one block (another process, a garbage collection) does not move the
    number: ``(ms, block_ms)``.

    ``installs``: ``{name: install()}`` of several caches, each installing its caches in the
    model: then ``{name: (ms, block_ms)}``, their blocks timed in turn (block ``i`` of each
    before block ``i + 1`` of any), each cache stepping through its own positions."""
    device = model.output.weight.device
    entries = {None: lambda: None} if installs is None else installs
    positions = [torch.tensor([position + i], device=device) for i in range(steps + 3)]
    tokens = {}
    for name, install in entries.items():
        install()
        token = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        tokens[name] = _decode_steps(model, step, token, positions[:3])  # compile, record, replay
    blocks = min(BLOCKS, steps)
    times = {name: [] for name in entries}
    for i in range(blocks):
        block = positions[3 + i * steps // blocks : 3 + (i + 1) * steps // blocks]
        for name, install in entries.items():
            install()
            sync(device.type)
            start = time.perf_counter()
            tokens[name] = _decode_steps(model, step, tokens[name], block)
            sync(device.type)
            times[name].append((time.perf_counter() - start) / len(block) * 1e3)
    timed = {name: (statistics.median(t), t) for name, t in times.items()}
    return timed[None] if installs is None else timed


def _decode_steps(model: Transformer, step, token: torch.Tensor, positions) -> torch.Tensor:
    """Run ``step`` at each of ``positions``, each step's token feeding the next; the last."""
    for pos in positions:
        token, _ = step(model, token, pos)
        token = token.clone()
    return token


@torch.no_grad()
def kernel_times(
    model: Transformer, step, batch: int, position: int, steps: int
) -> tuple[list[dict], list[dict]]:
    """GPU microseconds per decode step of each kernel (by name, summed over its launches;
    memory copies and sets too) over ``steps`` profiled steps at ``position, ...``, largest
    first, and the last step's launches (:func:`profiling.kernel_table`)."""
    device = model.output.weight.device
    token = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    positions = [torch.tensor([position + i], device=device) for i in range(steps)]
    sync(device.type)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _decode_steps(model, step, token, positions)
        sync(device.type)
    return kernel_table(prof, steps)


def set_caches(
    model: Transformer,
    cache: str,
    batch: int,
    context: int,
    num_splits: int | None = None,
    sinks: int | None = None,
    center_keys: bool = False,
) -> None:
    """Give ``model`` caches of kind ``cache`` (``DENSE`` names or a format; ``num_splits``:
    the TurboQuant caches' split count, default theirs; ``sinks``: theirs; ``center_keys``:
    theirs)."""
    gqa = DENSE.get(cache, "enable_gqa")
    for layer in model.layers:
        layer.attention.gqa = gqa
        layer.attention.kv_cache = None
    torch.cuda.empty_cache()
    factory = (
        KVCache
        if cache in DENSE
        else functools.partial(
            TurboQuantKVCache,
            preset=cache,
            num_splits=num_splits,
            sinks=sinks,
            center_keys=center_keys,
        )
    )
    model.setup_caches(batch, context, cache_factory=factory)


def run_cells(model: Transformer | None, args, fresh_processes: bool = False) -> list[dict]:
    """Every cell of ``args`` (modes x batches x contexts x the bf16 baseline, ``args.dense``
    and ``args.formats``), each row printed as it is timed; with ``args.capacity_gb`` each
    cache at its :func:`capacity_batch` instead of ``args.batches``.
    ``speedup`` is tokens per second over the baseline's (at equal batches, its time over the
    cell's). ``fresh_processes``: each ``reduce-overhead`` cell is timed in a process of its
    own (:func:`_time_cell_in_process`; ``model`` may then be None if no other mode is asked
    for)."""
    rows = []
    for mode in args.modes:
        for batch in [None] if args.capacity_gb else args.batches:
            for context in args.contexts:
                caches = [BASELINE, *args.dense, *args.formats]
                # eager cells are timed together; compiled ones one by one, each row printed
                # as soon as it is timed
                eager = {}
                if mode == "eager":
                    eager = _time_interleaved(model, args, batch, context, caches)
                base_tok_s = None
                for cache in caches:
                    if args.capacity_gb:
                        batch = capacity_batch(args, cache, context)
                    if batch == 0:  # not even one sequence fits the budget
                        cfg = ModelArgs.from_name(args.preset)
                        kv_bytes = _cache_bytes(cfg, cache, 1, context, args)
                        timed = dict(ms=None, kv_gb=kv_bytes / 1e9, over_budget=True)
                    elif mode == "reduce-overhead" and fresh_processes:
                        timed = _time_cell_in_process(args, mode, batch, context, cache)
                    else:
                        timed = eager.get(cache) or _time_cell(
                            model, args, mode, batch, context, cache
                        )
                    row = dict(mode=mode, batch=batch, context=context, cache=cache, **timed)
                    ms = row["ms"]
                    tok_s = batch / ms * 1e3 if ms else None
                    base_tok_s = tok_s if cache == BASELINE else base_tok_s
                    row.update(
                        tok_s=tok_s,
                        speedup=tok_s / base_tok_s if tok_s and base_tok_s else None,
                        max_context=int(
                            args.kv_budget_gb
                            * 1e9
                            * context
                            / (row["kv_gb"] * 1e9 * max(batch, 1))
                        ),
                    )
                    rows.append(row)
                    _print_row(row)
    return rows


def _time_cell(model: Transformer, args, mode: str, batch: int, context: int, cache: str) -> dict:
    """``ms`` (median block), ``block_ms``, ``kv_gb`` and, with ``--kernels``, ``kernels`` of
    one cell: its caches set up, filled, the step made for ``mode`` (compiled unless eager) and
    timed, then freed; ``ms`` None where the GPU ran out of memory."""
    try:
        filled = _filled_caches(model, args, batch, context, cache)
        result = dict(splits=_splits(model))
        step = step_function(mode)
        result["ms"], result["block_ms"] = time_decode(model, step, batch, filled, args.steps)
        if args.kernels:
            result["kernels"], result["timeline"] = kernel_times(
                model, step, batch, filled + args.steps + 3, args.kernels
            )
            result["attn_kernels"] = attention_kernels(
                result["kernels"], cache in DENSE, model.config.n_layer
            )
        result["kv_gb"] = kv_cache_nbytes(model) / 1e9
    except torch.cuda.OutOfMemoryError:
        result = dict(ms=None, kv_gb=_cache_bytes(model.config, cache, batch, context, args) / 1e9)
    _drop_caches(model)
    torch._dynamo.reset()
    return result


# the arguments of a cell timed in a process of its own (--cell), besides its coordinates
CELL_ARGS = ("preset", "steps", "kernels", "splits", "sinks", "center")
CELL_TIMEOUT_S = 1800  # a cell's process: compile, fill, time, profile


def _time_cell_in_process(
    args, mode: str, batch: int, context: int, cache: str, device: str = "cuda"
) -> dict:
    """:func:`_time_cell`'s result, timed by ``e2e.py --cell`` in a new Python process that
    builds the model itself on ``device`` (:func:`common.time_in_process`); ``ms`` None and an
    ``error`` where the process gave no result."""
    cell = dict(mode=mode, batch=batch, context=context, cache=cache, device=device)
    cell.update((name, getattr(args, name)) for name in CELL_ARGS)
    timed = time_in_process(__file__, cell, CELL_TIMEOUT_S)
    if "error" in timed:
        kv_bytes = _cache_bytes(ModelArgs.from_name(args.preset), cache, batch, context, args)
        timed.update(ms=None, kv_gb=kv_bytes / 1e9)
    return timed


def _time_cell_here(cell_json: str) -> None:
    """The ``--cell`` process: build the model of ``cell_json``'s preset, time that one cell
    (:func:`_time_cell`) and report its result (:func:`common.report_cell`)."""
    cell = json.loads(cell_json)
    args = argparse.Namespace(**{name: cell[name] for name in CELL_ARGS})
    model = _build_model(args.preset, cell["device"])
    report_cell(
        _time_cell(model, args, cell["mode"], cell["batch"], cell["context"], cell["cache"])
    )


def _build_model(preset: str, device: str = "cuda") -> Transformer:
    """The example model of ``preset`` with random bf16 weights (seed 0) on ``device``."""
    with torch.device(device):
        return (
            init_weights(Transformer(ModelArgs.from_name(preset)), seed=0)
            .to(torch.bfloat16)
            .eval()
        )


def _time_interleaved(
    model: Transformer, args, batch: int, context: int, caches: list[str]
) -> dict[str, dict]:
    """:func:`_time_cell`'s results for eager steps, every cache's caches alive at once and
    their blocks interleaved (block ``i`` of each cache before block ``i + 1`` of any): eager
    steps are host-bound, and a slow stretch of a shared host then slows a block of every
    cache, instead of the whole cell of one (one run measured 0.43x for a format that
    measured 0.74x in the next). Where the caches together would take more than half of the
    GPU's free memory, or run out of it, the cells are timed one by one instead, so that no
    cache is reported ``oom`` that fits alone."""
    cells = {
        cache: functools.partial(_time_cell, model, args, "eager", batch, context, cache)
        for cache in caches
    }
    device = model.output.weight.device
    if device.type == "cuda":
        need = sum(_cache_bytes(model.config, cache, batch, context, args) for cache in caches)
        if need > torch.cuda.mem_get_info(device)[0] / 2:
            return {cache: cell() for cache, cell in cells.items()}
    held, results = {}, {}

    def install(cache: str) -> None:
        for layer, (gqa, kv_cache) in zip(model.layers, held[cache], strict=True):
            layer.attention.gqa, layer.attention.kv_cache = gqa, kv_cache

    try:
        for cache in caches:
            filled = _filled_caches(model, args, batch, context, cache)
            held[cache] = [
                (layer.attention.gqa, layer.attention.kv_cache) for layer in model.layers
            ]
            results[cache] = dict(kv_gb=kv_cache_nbytes(model) / 1e9, splits=_splits(model))
        installs = {cache: functools.partial(install, cache) for cache in caches}
        timed = time_decode(model, decode_one_token, batch, filled, args.steps, installs)
        for cache, (ms, blocks) in timed.items():
            results[cache].update(ms=ms, block_ms=blocks)
            if args.kernels:
                install(cache)
                first = filled + args.steps + 3
                results[cache]["kernels"], results[cache]["timeline"] = kernel_times(
                    model, decode_one_token, batch, first, args.kernels
                )
                results[cache]["attn_kernels"] = attention_kernels(
                    results[cache]["kernels"], cache in DENSE, model.config.n_layer
                )
    except torch.cuda.OutOfMemoryError:
        results = None
    _drop_caches(model)
    held.clear()
    torch.cuda.empty_cache()
    return results or {cache: cell() for cache, cell in cells.items()}


def _filled_caches(model: Transformer, args, batch: int, context: int, cache: str) -> int:
    """Give ``model`` caches of kind ``cache`` holding the positions a cell's steps start
    from (room left for the warm-up, the timed and the profiled steps); that position."""
    set_caches(model, cache, batch, context, args.splits, args.sinks, args.center)
    filled = context - args.steps - 4 - args.kernels
    fill_caches(model, batch, filled, torch.Generator(model.output.weight.device).manual_seed(1))
    return filled


def _splits(model: Transformer) -> int | None:
    """The decode split count of ``model``'s TurboQuant caches (None for a dense cache): at
    large batches it decides how full the GPU is (``custom_ops/splits.py``)."""
    return getattr(model.layers[0].attention.kv_cache, "num_splits", None)


def _drop_caches(model: Transformer) -> None:
    for layer in model.layers:
        layer.attention.kv_cache = None


def _print_row(row: dict) -> None:
    print(_row_text(row), flush=True)
    if row.get("kernels"):
        total = sum(r["us"] for r in row["kernels"])
        idle = sum(r["idle_us"] for r in row["kernels"])
        print(
            f"  GPU time per step {total:.1f} us in "
            f"{sum(r['launches'] for r in row['kernels']):.0f} launches, {idle:.1f} us idle "
            "between them"
        )
        top = [dict(r, kernel=r["kernel"][:90]) for r in row["kernels"][:24]]
        print_table(top, dict(kernel="", us=".1f", launches=".0f", idle_us=".1f"))


def _cache_bytes(cfg: ModelArgs, cache: str, batch: int, context: int, args) -> int:
    """KV bytes a cache of this kind takes with ``args``' options (sinks, centering), without
    allocating it: for a capacity run's batch and for a cache that did not fit."""
    if cache in DENSE:
        preset, options = None, {}
    else:
        preset, options = cache, dict(sinks=args.sinks, center_keys=args.center)
    return kv_cache_bytes(
        preset, cfg.n_layer, cfg.n_local_heads, cfg.head_dim, batch, context, **options
    )


def capacity_batch(args, cache: str, context: int) -> int:
    """The most sequences of ``context`` slots whose KV cache of kind ``cache`` (with ``args``'
    options) fits ``args.capacity_gb`` in the model ``args.preset`` (0 where not even one
    does)."""
    cfg = ModelArgs.from_name(args.preset)
    return largest_batch(
        lambda batch: _cache_bytes(cfg, cache, batch, context, args), args.capacity_gb * 1e9
    )


def _row_text(row: dict) -> str:
    ms = _missing(row) if row["ms"] is None else f"{row['ms']:.2f} ms"
    speed = "" if row["speedup"] is None else f" {row['speedup']:.2f}x"
    return (
        f"{row['mode']:>15} B{row['batch']:<3} ctx {row['context']:>6} {row['cache']:>11}: "
        f"{ms}{speed}"
    )


def _missing(row: dict) -> str:
    """What a row without a time shows: ``failed`` (its process gave no result), ``over
    budget`` (a capacity run where not one sequence fits) or ``oom``."""
    if "error" in row:
        return "failed"
    return "over budget" if row.get("over_budget") else "oom"


def _printable(row: dict) -> dict:
    """``row`` with its timings as text (``oom`` where the cache did not fit)."""
    text = {"ms": "{:.2f}", "tok_s": "{:.0f}", "speedup": "{:.2f}x"}
    printable = {
        k: ((_missing(row) if v is None else fmt.format(v)) if (fmt := text.get(k)) else v)
        for k, v in row.items()
    }
    if row["ms"] is not None and row["speedup"] is None:  # timed, but no baseline to compare
        printable["speedup"] = "-"
    attn = row.get("attn_kernels")  # profiled cells only (--kernels)
    printable["attn_kernels"] = "-" if attn is None else f"{attn:.1f}"
    printable["splits"] = row.get("splits") or "-"  # TurboQuant caches only
    return printable


def host_cpu_us(call, n: int = 200) -> float:
    """CPU microseconds per eager call of ``call`` (its GPU work is far shorter at these
    shapes, so the loop's wall time is the host's): the fastest of :data:`BLOCKS` blocks of
    ``n`` calls, since other work on the host only ever adds to a block (shared machines
    moved the mean of one block by 2x between runs)."""
    for _ in range(10):
        call()
    blocks = []
    for _ in range(BLOCKS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            call()
        blocks.append((time.perf_counter() - start) / n * 1e6)
    torch.cuda.synchronize()
    return min(blocks)


def graph_gpu_us(call, n: int = 50) -> float:
    """GPU microseconds per call of ``call``, from a CUDA graph of ``n`` calls."""

    def calls() -> None:
        for _ in range(n):
            call()

    graph = capture(calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * n)


@torch.no_grad()
def host_table(cfg: ModelArgs, formats: list[str], context: int = 4096) -> list[dict]:
    """CPU microseconds per eager call of one layer's cache write and attention, B=1."""
    hq, hk, d = cfg.n_head, cfg.n_local_heads, cfg.head_dim
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, hq, 1, d, generator=gen, device="cuda").to(torch.bfloat16)
    k_new = torch.randn(1, hk, 1, d, generator=gen, device="cuda").to(torch.bfloat16)
    mask = torch.ones(1, 1, 1, context, dtype=torch.bool, device="cuda")
    pos = torch.tensor([context - 8], device="cuda")
    dense = KVCache(1, hk, context, d).cuda()
    k_all, v_all = dense.update(pos, k_new, k_new)
    rows = [
        dict(
            cache="bf16",
            call="KVCache.update",
            cpu_us=host_cpu_us(lambda: dense.update(pos, k_new, k_new)),
        ),
        dict(
            cache="bf16",
            call="SDPA (mask, enable_gqa)",
            cpu_us=host_cpu_us(
                lambda: F.scaled_dot_product_attention(
                    q, k_all, v_all, attn_mask=mask, enable_gqa=True
                )
            ),
        ),
    ]
    for fmt in formats:
        rows += _tq_host_rows(fmt, cfg, q, k_new, mask, pos, gen, context)
    return rows


def _tq_host_rows(fmt, cfg, q, k_new, mask, pos, gen, context) -> list[dict]:
    """The TurboQuant rows of :func:`host_table` for one format."""
    hk, d = cfg.n_local_heads, cfg.head_dim
    cache = TurboQuantKVCache(1, hk, context, d, preset=fmt, device="cuda")
    for start in range(0, context - 8, FILL_CHUNK):  # append in order, as a prefill would
        n = min(FILL_CHUNK, context - 8 - start)
        chunk = torch.randn(1, hk, n, d, generator=gen, device="cuda").to(torch.bfloat16)
        cache.update(torch.arange(start, start + n, device="cuda"), chunk, chunk)
    k_tq, v_tq = cache.update(pos, k_new, k_new)
    planes, table = (cache.k_codes, cache.v_codes, cache.meta), cache.block_table
    rings = (cache.k_window, cache.v_window, cache.window_pos)
    seq_lens = torch.full((1,), context - 7, dtype=torch.int32, device="cuda")
    start_pos = torch.full((1,), context - 8, dtype=torch.int32, device="cuda")
    q_rows = q[:, :, 0]  # [1, Hq, D]
    calls = {
        # an update at a fixed position writes the same token each time: the cost is the same
        "TurboQuantKVCache.update": lambda: cache.update(pos, k_new, k_new),
        "SDPA via TurboQuantKVTensor": lambda: F.scaled_dot_product_attention(
            q, k_tq, v_tq, attn_mask=mask, enable_gqa=True
        ),
        "tq.decode (raw op)": lambda: torch.ops.tq.decode(
            q_rows,
            *planes,
            table,
            seq_lens,
            cache.rotation,
            fmt,
            cache.num_splits,
            d**-0.5,
            None,
            *rings,
            cache.sinks,
        ),
        "tq.store_window (raw op)": lambda: torch.ops.tq.store_window(
            k_new, k_new, *planes, *rings, table, start_pos, cache.rotation, fmt, cache.sinks
        ),
    }
    rows = [dict(cache=fmt, call=call, cpu_us=host_cpu_us(fn)) for call, fn in calls.items()]
    # The append of a decode step: the ring is full, so each row also quantizes the token that
    # leaves it into its page. A replay at the same position would find its own token in the
    # slot and evict nothing: the slots' positions are restored before each call, and that
    # copy's own time subtracted.
    batch = 16
    big = TurboQuantKVCache(batch, hk, context, d, preset=fmt, device="cuda")
    held = 2 * big.window
    fill = torch.randn(batch, hk, held, d, generator=gen, device="cuda").to(torch.bfloat16)
    big.update(torch.arange(held, device="cuda"), fill, fill)
    k16 = torch.randn(batch, hk, 1, d, generator=gen, device="cuda").to(torch.bfloat16)
    start16 = torch.full((batch,), held, dtype=torch.int32, device="cuda")
    ring_positions = big.window_pos.clone()

    def restore() -> None:
        big.window_pos.copy_(ring_positions)

    restore_us = graph_gpu_us(restore)

    def append_us(append) -> float:
        return graph_gpu_us(lambda: (restore(), append())) - restore_us

    op_us = append_us(
        lambda: torch.ops.tq.store_window(
            k16,
            k16,
            big.k_codes,
            big.v_codes,
            big.meta,
            big.k_window,
            big.v_window,
            big.window_pos,
            big.block_table,
            start16,
            big.rotation,
            fmt,
            big.sinks,
        )
    )
    rows.append(dict(cache=fmt, call="tq.store_window B=16, T=1, ring full: GPU us", cpu_us=op_us))
    for block_rows, num_warps in ((1, 1), (2, 1), (16, 4)):  # the append's launch shape
        us = append_us(
            lambda r=block_rows, w=num_warps: triton_store_window.store_window(
                get_format(fmt),
                k16,
                k16,
                PagedKVCache(big.k_codes, big.v_codes, big.meta),
                RecentWindow(big.k_window, big.v_window, big.window_pos, big.sinks),
                big.block_table,
                start16,
                big.rotation,
                block_rows=r,
                num_warps=w,
            )
        )
        rows.append(
            dict(
                cache=fmt, call=f"  with {block_rows} rows x {num_warps} warps: GPU us", cpu_us=us
            )
        )
    return rows


def _batch_context(row: dict) -> tuple[int, int]:
    return row["batch"], row["context"]


def _batch_context_label(cell: tuple[int, int]) -> str:
    return f"B={cell[0]}\n{cell[1] // 1024}K"


def _context(row: dict) -> int:
    return row["context"]


def _context_label(context: int) -> str:
    return f"{context // 1024}K"


def plot_run(payload: dict, path: Path) -> None:
    """:func:`plot` of a run: cells are contexts in a capacity run (each cache at its own
    batch), batch x context otherwise."""
    if payload.get("capacity_gb"):
        plot(payload, path, cell=_context, label=_context_label)
    else:
        plot(payload, path)


def plot(payload: dict, path: Path, cell=_batch_context, label=_batch_context_label) -> None:
    """Speed-up over bf16 (enable_gqa) per cell, one panel per mode, one bar per cache; a
    row's cell is ``cell(row)`` (hashable), its tick ``label(cell)``. In a capacity run the
    bars also name their batch."""
    plt = pyplot()

    capacity = payload.get("capacity_gb")
    rows = [r for r in payload["rows"] if r["cache"] != BASELINE]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        cells = list(dict.fromkeys(cell(r) for r in rows if r["mode"] == mode))
        caches = list(dict.fromkeys(r["cache"] for r in rows if r["mode"] == mode))
        width = 0.8 / len(caches)
        for i, cache in enumerate(caches):
            mine = {cell(r): r for r in rows if r["mode"] == mode and r["cache"] == cache}
            speed = [(mine[c]["speedup"] or 0) if c in mine else 0 for c in cells]
            texts = [
                f"{s:.2f}" + (f"\nB{mine[c]['batch']}" if capacity and c in mine else "")
                for s, c in zip(speed, cells, strict=True)
            ]
            xs = [j + i * width for j in range(len(cells))]
            ax.bar_label(ax.bar(xs, speed, width, label=cache), texts, fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], [label(c) for c in cells])
        ax.set_title(mode)
        ax.set_ylabel(("tokens/s" if capacity else "speed-up") + " vs bf16 SDPA (enable_gqa)")
        ax.legend(fontsize=7)
    baseline = ", ".join(
        f"{BASELINE} B{r['batch']}" for r in payload["rows"] if r["cache"] == BASELINE
    )
    at = f",\neach cache at its largest batch in {capacity:g} GB ({baseline})" if capacity else ""
    fig.suptitle(f"{payload['preset']} decode step on {payload['gpu']}{at}")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b-shape")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--formats", nargs="*", default=["4bit_nc", "k8v4", "3bit_nc"])
    parser.add_argument(
        "--dense",
        nargs="*",
        default=["bf16-repeat"],
        choices=["bf16-repeat"],
        help="dense caches timed besides the bf16 baseline",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-budget-gb", type=float, default=40.0)
    parser.add_argument(
        "--capacity-gb",
        type=float,
        metavar="GB",
        help="each cache at the largest batch whose KV cache fits GB (instead of --batches); "
        "speed-up: tokens/s over bf16 at its own largest batch",
    )
    parser.add_argument(
        "--splits", type=int, help="the TurboQuant caches' decode split count (default: theirs)"
    )
    parser.add_argument(
        "--sinks",
        type=int,
        help="the TurboQuant caches' attention sinks (default: theirs, TurboQuantKVCache.sinks)",
    )
    parser.add_argument(
        "--center",
        action="store_true",
        help="TurboQuant caches with key centering (TurboQuantKVCache.center_keys)",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also profile N steps per cell: GPU time per kernel",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="time reduce-overhead cells in this process too (the first cell's graph is favoured)",
    )
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # (a cell's own process)
    parser.add_argument("--host", action="store_true", help="also the host-overhead table")
    parser.add_argument("--out", default="e2e.json")
    parser.add_argument("--plot", type=Path, help="only draw the PNG of a saved JSON run")
    args = parser.parse_args()
    if args.steps < 1 or args.kernels < 0:
        parser.error(f"need --steps >= 1 and --kernels >= 0, got {args.steps} and {args.kernels}")
    if args.capacity_gb is not None and (args.capacity_gb <= 0 or "eager" in args.modes):
        parser.error(
            f"--capacity-gb needs a budget > 0 and compiled modes (eager cells share one batch): "
            f"got {args.capacity_gb} GB, modes {args.modes}"
        )
    if args.plot:
        plot_run(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.cell:
        _time_cell_here(args.cell)
        return
    require_cuda("benchmarks/e2e.py")
    cfg = ModelArgs.from_name(args.preset)
    payload = dict(
        gpu=gpu_name(),
        preset=args.preset,
        kv_budget_gb=args.kv_budget_gb,
        capacity_gb=args.capacity_gb,
        num_splits=args.splits,
        sinks=args.sinks,
        center_keys=args.center,
        fresh_processes=not args.one_process,
    )
    if args.host:
        payload["host"] = host_table(cfg, args.formats)
        print(f"{gpu_name()}: one layer of {args.preset} at B=1, 4096 tokens")
        print_table(payload["host"], dict(cache="", call="", cpu_us=".1f"))
    in_process = args.one_process or bool(set(args.modes) - {"reduce-overhead"})
    model = _build_model(args.preset) if in_process else None
    payload["rows"] = run_cells(model, args, fresh_processes=payload["fresh_processes"])
    speedup = (
        f"tokens/s over bf16 SDPA with enable_gqa, same mode, each cache at its largest batch "
        f"in {args.capacity_gb:g} GB"
        if args.capacity_gb
        else "speed-up over bf16 SDPA with enable_gqa, same mode"
    )
    max_context = (
        ""
        if args.capacity_gb
        else f"; max_context: tokens per sequence whose KV cache fits {args.kv_budget_gb} GB"
    )
    print(f"{gpu_name()}, {args.preset}; {speedup}{max_context}")
    if payload["rows"]:
        columns = dict(
            mode="",
            batch="d",
            context="d",
            cache="",
            ms="",
            tok_s="",
            speedup="",
            kv_gb=".2f",
            max_context="d",
            splits="",
            attn_kernels="",
        )
        if args.capacity_gb:  # the batch comes from the budget: no context to trade for it
            del columns["max_context"]
        print_table([_printable(r) for r in payload["rows"]], columns)
    write_results(
        args.out,
        payload,
        plot_run if payload["rows"] else None,
        "python benchmarks/e2e.py --plot JSON",
    )


if __name__ == "__main__":
    main()
