"""Keep docs/reading.md's line counts those of the code.

The page lists the teaching core in one table between two markers, one file a row, its line
count in the column after the file, and a total row at the bottom:

    <!-- core: counted by docs/reading_counts.py -->
    | # | file | lines | what it teaches | run by hand in |
    | --- | --- | ---: | --- | --- |
    | 1 | `refmp/nn/layers.py` | 325 | ... | ... |
    | | **total** | **2966** | | |
    <!-- /core -->

``python docs/reading_counts.py`` rewrites every count (``wc -l`` of the file; a file not
written yet shows "-" and counts nothing) and the total; ``--check`` only reports counts that
differ, listed files that do not exist and paths named on the page that do not exist
(tests/test_docs.py runs it). To change the core, edit the table's rows and run the script.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reading.md"
CORE = re.compile(r"(<!-- core: counted by docs/reading_counts\.py -->\n)(.*?)(<!-- /core -->)", re.S)
ROW = re.compile(r"^(\|[^|\n]*\| `([^`]+)` \| )([0-9]+|-)( \|.*)$", re.M)
TOTAL = re.compile(r"^(\| *\| \*\*total\*\* \| \*\*)([0-9]+|-)(\*\* \|.*)$", re.M)
PATH = re.compile(r"`((?:refmp|tutorials|docs|tests|benchmarks)/[\w./]*)`")


def lines_of(path: str) -> int | None:
    """``wc -l`` of ``path`` (its newlines), or None where it does not exist."""
    f = ROOT / path
    return f.read_bytes().count(b"\n") if f.is_file() else None


def core(text: str) -> str:
    m = CORE.search(text)
    if m is None:
        raise SystemExit(f"{PAGE.name}: no <!-- core: counted by docs/reading_counts.py --> table")
    return m.group(2)


def listed(text: str) -> dict[str, str]:
    """The core's files, in reading order, and the count the page shows for each."""
    return {m.group(2): m.group(3) for m in ROW.finditer(core(text))}


def total_shown(text: str) -> int:
    m = TOTAL.search(core(text))
    if m is None:
        raise SystemExit(f"{PAGE.name}: the core table has no '| | **total** | **N** |' row")
    return int(m.group(2)) if m.group(2) != "-" else -1


def fresh(text: str) -> str:
    """The page with every count and the total as the files are now."""
    files = listed(text)
    total = sum(n for f in files if (n := lines_of(f)) is not None)

    def count(m: re.Match) -> str:
        n = lines_of(m.group(2))
        return f"{m.group(1)}{'-' if n is None else n}{m.group(4)}"

    table = ROW.sub(count, core(text))
    table = TOTAL.sub(lambda m: f"{m.group(1)}{total}{m.group(3)}", table)
    return CORE.sub(lambda m: m.group(1) + table + m.group(3), text, count=1)


def problems(text: str) -> list[str]:
    """What --check reports: each a line saying what to do."""
    out = []
    files = listed(text)
    if not files:
        out.append(f"{PAGE.name}: the core table lists no file")
    for f, shown in files.items():
        n = lines_of(f)
        if n is None:
            out.append(f"{f} is listed in docs/{PAGE.name} but does not exist: write it, or "
                       "remove its row")
        elif shown != str(n):
            out.append(f"{f}: the page shows {shown} lines, wc -l says {n}: run "
                       "`python docs/reading_counts.py`")
    total = sum(n for f in files if (n := lines_of(f)) is not None)
    if total_shown(text) != total:
        out.append(f"the total shows {total_shown(text)}, the files sum to {total}: run "
                   "`python docs/reading_counts.py`")
    for p in sorted(set(PATH.findall(text)) - set(files)):
        if not (ROOT / p).exists():
            out.append(f"docs/{PAGE.name} names {p}, which does not exist: give its new path")
    return out


if __name__ == "__main__":
    text = PAGE.read_text()
    if "--check" in sys.argv:
        found = problems(text)
        for line in found:
            print(line)
        sys.exit(1 if found else 0)
    new = fresh(text)
    if new != text:
        PAGE.write_text(new)
        print(f"updated: docs/{PAGE.name}")
    for f, shown in listed(new).items():
        if shown == "-":
            print(f"not written yet: {f}")
