"""examples/: the quick start runs and reports every format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from custom_ops.formats import FORMATS

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_reports_every_format():
    """``examples/quickstart.py`` runs on the CPU and prints one table row per format, with
    its bytes per token-head."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [
            sys.executable,
            "examples/quickstart.py",
            "--tokens",
            "64",
            "--head-dim",
            "64",
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    for name, fmt in FORMATS.items():
        assert name in rows, f"no row for {name} in:\n{result.stdout}"
        assert rows[name][1] == str(fmt.bytes_per_token_head(64))


def _run_example(*argv: str) -> str:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_generate_runs_and_reports():
    """``examples/generate.py`` (the main job) runs the tiny model on the CPU with a compiled
    decode step and reports speed, KV bytes vs bf16 and next-token agreement."""
    out = _run_example("examples/generate.py", "--device", "cpu", "--batch", "2",
                       "--prompt-len", "16", "--new-tokens", "8")  # fmt: skip
    assert "decode tokens/s: bf16" in out and "KV cache:" in out
    assert "next-token agreement with the bf16 cache:" in out


def test_cuda_graph_loop_runs_on_cpu():
    """``examples/cuda_graph_loop.py`` falls back to eager steps without CUDA."""
    out = _run_example("examples/cuda_graph_loop.py", "--device", "cpu", "--steps", "4")
    assert "eager steps (no CUDA)" in out and "4 steps:" in out
