"""benchmarks/quality.py: the perplexity benchmark runs end to end on the CPU (tiny model)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

from conftest import ROOT


def test_quality_tiny_cpu_reports_bf16_and_4bit(tmp_path):
    """``benchmarks/quality.py --tiny`` trains a tiny byte-level model (cached under
    ``--cache-dir``), decodes through the bf16 cache and ``4bit_nc`` caches with windows 0 and
    8 (crossed by the 24 positions) and reports each with a
    finite perplexity, in its table and in the JSON at ``--out`` (the PNG beside it when
    matplotlib is installed); nothing is written to ``benchmarks/results``."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
    )
    out = tmp_path / "quality.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/quality.py",
            "--tiny",
            "--device",
            "cpu",
            "--formats",
            "4bit_nc",
            "--windows",
            "0",
            "8",
            "--eval-seqs",
            "2",
            "--eval-len",
            "24",
            "--steps",
            "3",
            "--cache-dir",
            str(tmp_path / "cache"),
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
    table = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    ppl = table["cache"].index("ppl")  # the header row names the columns
    for cache in ("bf16", "4bit_nc"):
        assert cache in table, f"no row for {cache} in:\n{result.stdout}"
        assert math.isfinite(float(table[cache][ppl])), table[cache]
    rows = {(row["cache"], row["window"]): row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows, key=str) == [("4bit_nc", 0), ("4bit_nc", 8), ("bf16", None)]
    assert all(math.isfinite(row["ppl"]) and row["ppl"] > 1 for row in rows.values())
    bf16 = rows["bf16", None]
    assert bf16["ppl_delta_pct"] == 0 and bf16["top1_pct"] == 100
    assert list((tmp_path / "cache").glob("tiny-*.pt")), "the trained model was not cached"
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").exists()
