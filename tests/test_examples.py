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
