"""Every Python block in README.md and docs/ runs, so published examples never rot.

The blocks of one page run in order, in one fresh interpreter, as one script
(a later block may use what an earlier one defined), in an empty temporary
folder. A failing block is reported with its page and line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each fenced Python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in _BLOCK.finditer(text)
    ]


def page_script(page: Path) -> str:
    """The page's blocks as one script; each starts on its own line in the page."""
    parts = []
    for line, source in python_blocks(page):
        parts.append(f"# ---- {page.relative_to(ROOT)}:{line}\n{source}")
    return "\n".join(parts)


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if python_blocks(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_python_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    script = tmp_path / "snippets.py"
    script.write_text(page_script(page), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PERSISTENCE_MODULE", None)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"a Python block of {page.relative_to(ROOT)} failed "
        f"(see the '# ---- page:line' marker above the failing line):\n{done.stderr}"
    )


def test_the_pages_have_python_blocks_to_run() -> None:
    pages_with_code = [p.name for p in PAGES if python_blocks(p)]
    assert "README.md" in pages_with_code
    assert "getting-started.md" in pages_with_code
