"""Every ```python block of README.md and docs/*.md runs as written (issue 46: the README's library
snippet imported a name its module never had, and nothing ran it).

A block that cannot run here says so in the line just above its fence:
``<!-- doc-test: skip: REASON -->``; it is reported as a skip with that reason, never dropped
silently. A ``toml`` block of the same file whose first line is ``# NAME.toml...`` is written to
the block's working directory as NAME.toml, so a snippet may load the file its page shows; a
``<... printed by shuffle-keygen>`` placeholder in it gets a fresh public key, and the relative
key files it names are made (tests/helpers/docs.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docs import blocks, write_page_files

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


CASES = [
    pytest.param(page, line, text, skip, id=f"{page.relative_to(ROOT)}:{line}")
    for page in PAGES
    for lang, line, text, skip in blocks(page)
    if lang == "python"
]


def test_readme_has_a_python_block():
    assert any(p.id.startswith("README.md:") for p in CASES)


@pytest.mark.parametrize("page,line,text,skip", CASES)
def test_python_block_runs(page, line, text, skip, tmp_path):
    if skip:
        pytest.skip(f"marked in the page: {skip}")
    write_page_files(page, tmp_path, make_keys=True)
    script = tmp_path / "snippet.py"
    script.write_text(text)
    res = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, f"{page.name}:{line} failed:\n{res.stderr[-3000:]}"


def test_the_api_page_runs_and_the_readme_points_to_it():
    """Issue 54: the Python API's page has snippets this suite runs, and the README's library
    section shows the API and links the page."""
    api = [p for p in CASES if p.id.startswith("docs/api.md:")]
    assert sum(1 for p in api if p.values[3] is None) >= 3
    readme = (ROOT / "README.md").read_text()
    library = readme.split("## Library", 1)[1].split("\n## ", 1)[0]
    assert "docs/api.md" in library and "from aggregator.api import" in library
