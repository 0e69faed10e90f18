"""The README's Python programs (its ```python blocks that start with an import; the others are
signatures and one-line fragments) run as written from the repository root."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, require_smollm2
from helpers import run_example

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
SNIPPETS = [block for block in BLOCKS if block.startswith(("import ", "from "))]


def test_readme_has_its_programs():
    """The Hugging Face, gpt-fast and ops examples."""
    assert len(SNIPPETS) == 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index, tmp_path):
    """Each ```python block of the README runs in a fresh interpreter without error."""
    code = SNIPPETS[index]
    if "load_smollm2" in code:
        pytest.importorskip("transformers")
        require_smollm2()
    script = tmp_path / f"readme_snippet_{index}.py"
    script.write_text(code)
    run_example(str(script), timeout=600)
