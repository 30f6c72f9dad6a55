"""Keep the code shown in docs/*.md identical to the tested source it comes from.

A page shows code by naming it in a marker, followed by a fenced block:

    <!-- code: refmp/nn/layers.py layernorm_backward -->
    ```python
    ...filled in by this script...
    ```

``python docs/sync_code.py`` rewrites every such block from the named function or class
(found with ``ast``); ``--check`` only reports blocks that differ (tests/test_docs.py runs it),
so the docs cannot drift away from the code.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- code: (\S+) (\S+) -->\n```python\n(.*?)```\n", re.S)


def source_of(path: str, name: str) -> str:
    """The source of function or class ``name`` in ``path`` (``Class.method`` for a method)."""
    text = (ROOT / path).read_text()
    body = ast.parse(text).body
    *outer, last = name.split(".")
    for part in outer:  # descend into classes
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == part)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == last:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = text.splitlines()[start - 1 : node.end_lineno]
            indent = len(lines[0]) - len(lines[0].lstrip())
            return "\n".join(line[indent:] for line in lines) + "\n"
    raise KeyError(f"{path}: no function or class {name!r}")


def sync(check: bool) -> list[str]:
    stale = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()

        def fill(m, page=page):
            fresh = source_of(m.group(1), m.group(2))
            if fresh != m.group(3):
                stale.append(f"{page.name}: {m.group(1)} {m.group(2)}")
            return f"<!-- code: {m.group(1)} {m.group(2)} -->\n```python\n{fresh}```\n"

        new = MARKER.sub(fill, text)
        if not check and new != text:
            page.write_text(new)
    return stale


if __name__ == "__main__":
    check = "--check" in sys.argv
    stale = sync(check)
    for s in stale:
        print(("stale: " if check else "updated: ") + s)
    sys.exit(1 if (check and stale) else 0)
