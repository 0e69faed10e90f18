"""benchmarks/e2e.py's cells on the CPU (tiny model): eager cells hold every cache at once and
interleave their timed blocks, and fall back to one cell at a time when that runs out of
memory (no cache reported ``oom`` that fits alone)."""

from __future__ import annotations

import math
import sys
from argparse import Namespace

import pytest
import torch
from conftest import ROOT

from examples.model import ModelArgs, Transformer, init_weights

sys.path.insert(0, str(ROOT / "benchmarks"))
import e2e  # noqa: E402

STEPS = 5


@pytest.fixture
def model() -> Transformer:
    return init_weights(Transformer(ModelArgs.from_name("tiny")), seed=0).to(torch.bfloat16).eval()


def _args() -> Namespace:
    return Namespace(
        modes=["eager"],
        batches=[1],
        contexts=[48],
        formats=["4bit_nc"],
        dense=[],
        steps=STEPS,
        kernels=0,
        splits=None,
        sinks=None,
        center=False,
        kv_budget_gb=1.0,
        capacity_gb=None,
        preset="tiny",
    )


def _cache_kinds(monkeypatch) -> list[str]:
    """The kind of cache each timed call of ``_decode_steps`` ran with, in order."""
    kinds, steps = [], e2e._decode_steps

    def recording(model, step, token, positions):
        kinds.append(type(model.layers[0].attention.kv_cache).__name__)
        return steps(model, step, token, positions)

    monkeypatch.setattr(e2e, "_decode_steps", recording)
    return kinds


def test_eager_cells_interleave_the_caches_blocks(model, monkeypatch):
    """After each cache's warm-up call, the five timed blocks alternate between the caches;
    each row has five finite blocks."""
    kinds = _cache_kinds(monkeypatch)
    rows = e2e.run_cells(model, _args())
    assert [row["cache"] for row in rows] == ["bf16", "4bit_nc"]
    assert kinds == ["KVCache", "TurboQuantKVCache"] * (1 + 5), kinds
    for row in rows:
        assert len(row["block_ms"]) == 5 and all(math.isfinite(b) for b in row["block_ms"])
    # the TurboQuant cache's decode split count (1 off CUDA), none for bf16
    assert [e2e._printable(row)["splits"] for row in rows] == ["-", 1]


def test_eager_cells_one_by_one_when_holding_every_cache_runs_out(model, monkeypatch):
    """A cache whose setup runs out of memory while another is held is timed alone, after the
    held ones are freed: every cache gets its time, none is reported ``oom``."""
    fills, fill = [], e2e.fill_caches

    def fill_failing_second(model, batch, context, gen):
        fills.append(type(model.layers[0].attention.kv_cache).__name__)
        if len(fills) == 2:
            raise torch.cuda.OutOfMemoryError("two caches do not fit")
        fill(model, batch, context, gen)

    monkeypatch.setattr(e2e, "fill_caches", fill_failing_second)
    kinds = _cache_kinds(monkeypatch)
    rows = e2e.run_cells(model, _args())
    assert fills == ["KVCache", "TurboQuantKVCache", "KVCache", "TurboQuantKVCache"], fills
    assert kinds == ["KVCache"] * 6 + ["TurboQuantKVCache"] * 6, kinds
    assert all(row["ms"] is not None and math.isfinite(row["ms"]) for row in rows), rows


def test_a_cell_in_a_process_of_its_own():
    """``reduce-overhead`` cells are timed each in a new process (``e2e.py --cell``), which
    builds the model from the cell's preset and prints the cell's result for the parent: here
    an eager cell of the tiny model on the CPU, through the same plumbing."""
    timed = e2e._time_cell_in_process(_args(), "eager", 1, 48, "4bit_nc", device="cpu")
    assert len(timed["block_ms"]) == STEPS and math.isfinite(timed["ms"]), timed
    assert timed["kv_gb"] > 0 and timed["splits"] == 1


def test_a_cell_process_reports_its_result_or_its_failure(tmp_path):
    """``common.time_in_process``: the result a cell's process reports (``report_cell``), an
    ``error`` row where it exits without one or outlives its timeout."""
    import common

    script = tmp_path / "cell.py"
    script.write_text(
        "import json, sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from common import report_cell\n"
        "cell = json.loads(sys.argv[2])\n"
        "time.sleep(cell['sleep'])\n"
        "if cell['ok']:\n"
        "    report_cell(dict(ms=cell['ms']))\n"
        "sys.exit(0 if cell['ok'] else 3)\n"
    )
    assert common.time_in_process(script, dict(ok=True, ms=1.5, sleep=0), 600) == dict(ms=1.5)
    assert common.time_in_process(script, dict(ok=False, ms=0, sleep=0), 600) == dict(
        error="exit code 3"
    )
    assert common.time_in_process(script, dict(ok=True, ms=0, sleep=30), 1) == dict(
        error="no result in 1 s"
    )


def _capacity_args(budget_bytes: float, **fields) -> Namespace:
    return Namespace(**dict(vars(_args()), capacity_gb=budget_bytes / 1e9, **fields))


def test_capacity_batch_is_the_most_sequences_that_fit_the_budget():
    """The batch a capacity run gives a cache fits the budget (with the run's sinks) and one more
    sequence does not; a budget below one sequence gives 0."""
    cfg = ModelArgs.from_name("tiny")
    for cache, sinks in (("bf16", None), ("4bit_nc", None), ("4bit_nc", 64), ("3bit_nc", None)):
        args = _capacity_args(0, sinks=sinks)
        one = e2e._cache_bytes(cfg, cache, 1, 256, args)
        for budget in (one, 10.5 * one, 1e9):
            args = _capacity_args(budget, sinks=sinks)
            batch = e2e.capacity_batch(args, cache, 256)
            assert e2e._cache_bytes(cfg, cache, batch, 256, args) <= budget, (cache, budget)
            assert e2e._cache_bytes(cfg, cache, batch + 1, 256, args) > budget, (cache, budget)
        assert e2e.capacity_batch(_capacity_args(one - 1, sinks=sinks), cache, 256) == 0
    # sinks are bf16 slots of their own: a cache with 64 of them holds fewer sequences
    plain, sunk = (_capacity_args(1e6, sinks=sinks) for sinks in (None, 64))
    assert e2e.capacity_batch(sunk, "4bit_nc", 256) < e2e.capacity_batch(plain, "4bit_nc", 256)


def test_capacity_cells_take_each_cache_at_its_largest_batch(monkeypatch):
    """``--capacity-gb``: each cache is timed at the largest batch its KV cache fits in the
    budget (compiled cells in processes of their own get that batch too), and its speed-up is
    tokens per second over bf16's at bf16's own batch."""
    cfg = ModelArgs.from_name("tiny")
    timed = []

    def fake_cell(args, mode, batch, context, cache):
        timed.append((cache, batch))
        return dict(ms=2.0 if cache == "bf16" else 3.0, kv_gb=1.0)

    monkeypatch.setattr(e2e, "_time_cell_in_process", fake_cell)
    args = _capacity_args(0, modes=["reduce-overhead"], contexts=[256])
    args.capacity_gb = 8 * e2e._cache_bytes(cfg, "bf16", 1, 256, args) / 1e9
    rows = e2e.run_cells(None, args, fresh_processes=True)
    batches = {cache: e2e.capacity_batch(args, cache, 256) for cache in ("bf16", "4bit_nc")}
    assert batches["bf16"] == 8 and batches["4bit_nc"] > 10, batches
    assert timed == list(batches.items())
    bf16, tq = rows
    assert bf16["speedup"] == 1.0
    assert tq["speedup"] == pytest.approx((batches["4bit_nc"] / 3.0) / (8 / 2.0))


def test_a_cache_over_the_capacity_budget_is_not_timed(monkeypatch):
    """A budget below one bf16 sequence: bf16 is reported ``over budget`` (not ``oom``) without
    being timed, and the TurboQuant cache that fits is timed but has no speed-up to show."""
    cfg = ModelArgs.from_name("tiny")
    timed = []

    def fake_cell(model, args, mode, batch, context, cache):
        timed.append(cache)
        return dict(ms=3.0, kv_gb=1.0)

    monkeypatch.setattr(e2e, "_time_cell", fake_cell)
    args = _capacity_args(0, modes=["default"], contexts=[256])
    args.capacity_gb = 0.9 * e2e._cache_bytes(cfg, "bf16", 1, 256, args) / 1e9
    bf16, tq = e2e.run_cells(None, args)
    assert timed == ["4bit_nc"] and bf16["batch"] == 0 and tq["batch"] >= 1
    assert e2e._printable(bf16)["ms"] == "over budget"
    assert e2e._printable(tq)["speedup"] == "-" and e2e._printable(tq)["ms"] == "3.00"
