"""benchmarks/tp.py: the tensor-parallel benchmark runs end to end on the CPU (gloo, tiny model).

It imports benchmarks/e2e.py's cells (``run_cells``) and its arguments' fields, which changed
under it once without a test noticing; this run checks every piece, not any time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import ROOT


def test_tp_benchmark_on_two_cpu_ranks(tmp_path):
    """``torchrun --nproc-per-node 2 benchmarks/tp.py --modes eager`` (``--standalone``: a free
    port) writes a JSON with the TP=2 cells and rank 0's one-device cells, bf16 and 4bit_nc,
    each timed in e2e.py's five blocks, and the comparison of the two readings."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    out = tmp_path / "tp.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "benchmarks/tp.py",
            "--modes",
            "eager",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    cells = sorted((row["world_size"], row["cache"]) for row in payload["rows"])
    assert cells == [(1, "4bit_nc"), (1, "bf16"), (2, "4bit_nc"), (2, "bf16")], cells
    for row in payload["rows"]:
        assert len(row["block_ms"]) == 5 and math.isfinite(row["ms"]) and row["ms"] > 0, row
    assert payload["comparison"], payload
