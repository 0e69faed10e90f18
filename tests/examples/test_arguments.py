"""The example programs refuse bad arguments before any work, naming the argument (issue 53:
``generate.py --format bogus`` ran the whole bf16 pass before a traceback;
``cuda_graph_loop.py --device cuda`` without CUDA gave a raw ``AssertionError``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

CASES = [
    ("generate.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("generate.py", ["--preset", "huge"], "--preset: invalid choice: 'huge'"),
    ("speculative.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("cuda_graph_loop.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("cuda_graph_loop.py", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("chat.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
]
if not torch.cuda.is_available():
    CASES.append(("cuda_graph_loop.py", ["--device", "cuda"], "--device cuda: torch"))


@pytest.mark.parametrize(("script", "args", "message"), CASES)
def test_bad_arguments_stop_before_any_work(script, args, message):
    result = subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr.strip().splitlines()[-1]
