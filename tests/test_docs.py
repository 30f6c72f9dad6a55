"""The docs show code from the tested source, not copies that drift (docs/sync_code.py)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_doc_code_blocks_match_the_source():
    r = subprocess.run([sys.executable, "docs/sync_code.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "run `python docs/sync_code.py`:\n" + r.stdout + r.stderr


def test_every_doc_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"
