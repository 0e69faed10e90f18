"""The example programs refuse bad arguments at once, before torch and the kernels are imported,
naming the argument (issue 53: ``generate.py --format bogus`` ran the whole bf16 pass before a
traceback; ``cuda_graph_loop.py --device cuda`` without CUDA gave a raw ``AssertionError``);
the choices they parse without importing anything (``examples/arguments.py``) are the library's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from custom_ops import FORMATS, SUPPORTED_HEAD_DIMS
from examples import arguments
from examples.model import transformer_configs

CASES = [
    ("generate.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("generate.py", ["--preset", "huge"], "--preset: invalid choice: 'huge'"),
    ("generate.py", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("speculative.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("speculative.py", ["--drafts", "16"], "--drafts must be in [1, 15]"),
    ("cuda_graph_loop.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("cuda_graph_loop.py", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("chat.py", ["--format", "bogus"], "--format: invalid choice: 'bogus'"),
    ("chat.py", ["--window", "-1"], "--window must be >= 0, got -1"),
    ("quickstart.py", ["--head-dim", "7"], "--head-dim: invalid choice: 7"),
    ("tp.py", ["--cache", "bogus"], "--cache: invalid choice: 'bogus'"),
]
if not any(Path(f).exists() for f in arguments.GPU_DRIVER_FILES):
    CASES.append(("cuda_graph_loop.py", ["--device", "cuda"], "--device cuda: this machine"))

# Runs an example as `python examples/<script> <args>` would, and reports whether torch had been
# imported when it exited.
_RUN = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    print("torch" in sys.modules, exit.code)
"""


@pytest.mark.parametrize(("script", "args", "message"), CASES)
def test_bad_arguments_stop_before_torch_is_imported(script, args, message):
    result = subprocess.run(
        [sys.executable, "-c", _RUN, f"examples/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split() == ["False", "2"], result.stdout + result.stderr[-2000:]
    assert message in result.stderr.strip().splitlines()[-1]


def test_choices_read_from_source_are_the_librarys():
    """The names the examples read as text (no import) are those the library defines."""
    assert arguments.format_names() == tuple(sorted(FORMATS))
    assert arguments.head_dims() == SUPPORTED_HEAD_DIMS
    assert arguments.model_sizes() == tuple(sorted(transformer_configs))
