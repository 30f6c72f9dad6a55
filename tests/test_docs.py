"""The guide says what the code does: its code blocks are the tested source (docs/sync_code.py),
its reading path counts the files' lines (docs/reading_counts.py), its flag table is the
parser's, its pages describe the project as it is, and the script its collectives page quotes
runs. The site itself is tested in tests/test_site.py."""

import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_doc_code_blocks_match_the_source():
    r = subprocess.run([sys.executable, "docs/sync_code.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "run `python docs/sync_code.py`:\n" + r.stdout + r.stderr


def test_the_reading_path_is_the_code():
    """docs/reading.md's core: every listed file exists, its count is its `wc -l`, the total
    their sum, and every path the page names exists."""
    r = subprocess.run([sys.executable, "docs/reading_counts.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


CORE_LINES = 2600  # the teaching core's bound: about 2,500 (docs/reading.md)


def test_the_teaching_core_stays_small():
    counts = runpy.run_path(str(DOCS / "reading_counts.py"))
    files = counts["listed"]((DOCS / "reading.md").read_text())
    sizes = {f: counts["lines_of"](f) or 0 for f in files}
    total = sum(sizes.values())
    biggest = ", ".join(f"{f} ({n})" for f, n in sorted(sizes.items(), key=lambda x: -x[1])[:3])
    assert total <= CORE_LINES, (f"docs/reading.md's core has {total} lines, over {CORE_LINES}: "
                                 f"move what only the engine needs out of it (largest: {biggest})")


def test_the_index_links_every_page():
    index = (DOCS / "index.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_the_flag_table_is_the_parser():
    """docs/cli.md's table of `refmp train` lists every flag `refmp train --help` shows, once."""
    r = subprocess.run([sys.executable, "-m", "refmp", "train", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # the option column: two spaces in (help text wraps further in, and names other flags)
    parser = set(re.findall(r"^  (?:-\w, )?(--[a-z][a-z0-9-]*)", r.stdout, re.M)) - {"--help"}
    page = (DOCS / "cli.md").read_text()
    section = page.split("## `refmp train`")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(--[a-z][a-z0-9-]*)` \|", section, re.M)
    assert len(rows) == len(set(rows)), "a flag is listed twice"
    assert set(rows) == parser, {"missing": parser - set(rows), "not a flag": set(rows) - parser}


def test_the_tutorials_are_numbered_in_the_guides_order():
    """mkdocs.yml's numbered entries ("N · title") run 1, 2, ... in the nav's order, and the
    page of entry N (its first page) runs tutorials/NN_*.py, which exists."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1].splitlines()
    numbered = []
    for i, line in enumerate(nav):
        m = re.match(r'\s*- "(\d+) · [^"]*":\s*(\S+\.md)?\s*$', line)
        if m:
            page = m.group(2) or re.search(r"(\S+\.md)\s*$", nav[i + 1]).group(1)
            numbered.append((int(m.group(1)), page))
    assert [n for n, _ in numbered] == list(range(1, len(numbered) + 1)), numbered
    for n, page in numbered:
        names = set(re.findall(rf"tutorials/({n:02d}_\w+\.py)", (DOCS / page).read_text()))
        assert names and all((ROOT / "tutorials" / name).is_file() for name in names), (n, page)


HISTORY = re.compile(r"\bsessions?\b|first version|earlier version|the code before|used to "
                     r"\w+ (?:show|be|scatter|probe)|\bwas once\b|\b20\d\d-\d\d-\d\d\b", re.I)


def test_no_page_narrates_history():
    """Pages describe the code as it is: no sessions, versions or dates of measurements."""
    hits = [f"{page.name}:{i}: {line.strip()}" for page in sorted(DOCS.glob("*.md"))
            for i, line in enumerate(page.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec")
def test_the_collectives_script_runs():
    """benchmarks/collectives.py (docs/collectives.md), on tiny messages: it fits and prints."""
    r = subprocess.run(["mpiexec", "-n", "2", sys.executable, "benchmarks/collectives.py",
                        "--max-mib", "0.001", "--reps", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fitted alpha" in r.stdout and "| allreduce |" in r.stdout and "| send |" in r.stdout
