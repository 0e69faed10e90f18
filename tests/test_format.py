"""The formatter policy: every Python file is as ``ruff format`` writes it and passes ``ruff
check``, with pyproject's ``[tool.ruff]`` settings (99 columns), and no ``# fmt: skip`` marker
opts a line out."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> str | None:
    """The ruff beside this interpreter (``scripts/setup_env.sh`` installs it), or on PATH."""
    beside = pathlib.Path(sys.executable).with_name("ruff")
    return str(beside) if beside.exists() else shutil.which("ruff")


RUFF = _ruff()
needs_ruff = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (setup_env.sh has it)")


@needs_ruff
@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff(command):
    result = subprocess.run([RUFF, *command, str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_formatter_opt_outs():
    marked = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("custom_ops", "tq_compile", "tests", "benchmarks", "examples", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt" + ": skip")
    ]
    assert not marked, marked
