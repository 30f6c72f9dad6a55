"""MkDocs hook: every file of the teaching core (docs/reading.md's table) as a page of its own,
its notes beside the lines they explain, the way nn.labml.ai shows its implementations.

The page is made from the file while the site is built, so it cannot drift from the code. A
file is cut into *sections* where its notes are:

* a docstring (the module's, a class's, a function's) is the note of the lines from its
  ``def`` or ``class`` (decorators included) to the next note;
* a run of whole-line comments is the note of the code lines after it, up to the next note;
  a comment run right above a ``def`` with a docstring joins that docstring's note.

The notes leave the code column (a comment at the end of a code line stays with its line, as
the shape comments do); every other line of the file is shown once, in order, with its line
number. Notes are Markdown as the site reads it (``code``, lists, indented blocks kept as they
are written), and TeX between ``\\(`` and ``\\)`` (or ``\\[`` and ``\\]``) is turned into
MathML by the site's own converter (docs/_hooks/mathml.py). The code is coloured by Pygments
with the theme's classes.

Each page is ``source/<module>.md`` (``source/refmp.nn.layers.md``), outside the nav; the
reading table and the concept pages link to them.
"""

from __future__ import annotations

import ast
import html
import io
import pathlib
import re
import tokenize
from dataclasses import dataclass, field

import markdown
from mathml import on_page_content as typeset
from mkdocs.structure.files import File
from pygments.lexers import PythonLexer
from pygments.token import STANDARD_TYPES

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
CORE = re.compile(r"<!-- core: counted by docs/reading_counts\.py -->\n(.*?)<!-- /core -->", re.S)
ROW = re.compile(r"^\|[^|\n]*\| `([^`]+\.py)` \|", re.M)
RULE = re.compile(r"^-{2,}\s*(.*?)\s*-*$")  # "# --- a heading ---"
PAGES: dict[str, str] = {}  # page (source/...md) -> the core file it shows


def core_files(reading: str) -> list[str]:
    """The core's files in reading order, from docs/reading.md's table."""
    m = CORE.search(reading)
    return ROW.findall(m.group(1)) if m else []


def page_of(path: str) -> str:
    """The site page of a core file: refmp/nn/layers.py -> source/refmp.nn.layers.md."""
    return "source/" + path.removesuffix(".py").replace("/", ".") + ".md"


@dataclass
class Section:
    """A note and the lines it explains (1-based numbers of the file's lines)."""

    note: list[str] = field(default_factory=list)  # Markdown paragraphs
    code: list[int] = field(default_factory=list)


@dataclass
class Cut:
    """A file cut into sections, and which lines went into notes."""

    sections: list[Section]
    comments: set[int]  # whole-line comments
    docstrings: set[int]  # the lines of docstrings


def docstrings(tree: ast.Module) -> dict[int, tuple[int, range, str]]:
    """{first line of the header: (header line, the docstring's lines, its text)}."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        doc = body[0]
        start = 1 if isinstance(node, ast.Module) else min(
            [node.lineno] + [d.lineno for d in node.decorator_list])
        if start == doc.lineno and not isinstance(node, ast.Module):
            continue  # a docstring on its def's own line stays in the code
        out[start] = (start, range(doc.lineno, doc.end_lineno + 1), ast.get_docstring(node))
    return out


def comment_lines(source: str) -> dict[int, str]:
    """{line: text} of the comments that fill a line of their own."""
    lines = source.splitlines()
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][:tok.start[1]].strip():
            out[tok.start[0]] = tok.string[1:].removeprefix(" ")
    return out


def comment_note(texts: list[str]) -> str:
    """A run of comments as Markdown: "--- heading ---" lines in bold, the rest as written."""
    out = []
    for t in texts:
        m = RULE.match(t)
        out.append(f"**{m.group(1)}**\n" if m and m.group(1) else t)
    return "\n".join(out)


def cut(source: str) -> Cut:
    """The file's sections (module docstring first), every line in exactly one place."""
    docs = docstrings(ast.parse(source))
    comments = comment_lines(source)
    in_doc = {n for _, rows, _ in docs.values() for n in rows}
    sections = [Section()]
    run: list[str] = []  # the comments being read

    def new_section() -> None:
        if sections[-1].code or (sections[-1].note and not run):
            sections.append(Section())

    for n in range(1, len(source.splitlines()) + 1):
        if n in docs:  # a header whose docstring is a note: a section starts here
            if not run:
                new_section()
            if run:  # the comments right above join it
                sections[-1].note.append(comment_note(run))
                run = []
            sections[-1].note.append(docs[n][2])
        if n in in_doc:
            continue
        if n in comments:
            if not run:
                new_section()
            run.append(comments[n])
            continue
        if run:
            sections[-1].note.append(comment_note(run))
            run = []
        sections[-1].code.append(n)
    if run:
        sections[-1].note.append(comment_note(run))
    blank = {n for n, line in enumerate(source.splitlines(), 1) if not line.strip()}
    for s in sections:  # no blank lines at either end of a section's code
        while s.code and s.code[0] in blank:
            s.code.pop(0)
        while s.code and s.code[-1] in blank:
            s.code.pop()
    kept: list[Section] = []
    carried: list[str] = []  # the notes of a section without code (a heading) go on down
    for s in sections:
        if s.code:
            kept.append(Section(carried + s.note, s.code))
            carried = []
        else:
            carried += s.note
    if carried:
        kept.append(Section(carried, []))
    return Cut(kept, set(comments), in_doc)


def coloured_lines(source: str) -> list[str]:
    """Each line of the file as HTML, coloured with the short Pygments classes the theme styles."""
    lines, cur = [], []
    for ttype, value in PythonLexer(stripnl=False, ensurenl=False).get_tokens(source):
        while ttype not in STANDARD_TYPES:
            ttype = ttype.parent
        cls = STANDARD_TYPES[ttype]
        for i, piece in enumerate(value.split("\n")):
            if i:
                lines.append("".join(cur))
                cur = []
            if piece:
                text = html.escape(piece, quote=False)
                cur.append(f'<span class="{cls}">{text}</span>' if cls else text)
    lines.append("".join(cur))
    return lines


MD = markdown.Markdown(extensions=["pymdownx.arithmatex"],
                       extension_configs={"pymdownx.arithmatex": {"generic": True}})


def note_html(paragraphs: list[str]) -> str:
    MD.reset()
    return MD.convert("\n\n".join(paragraphs))


STYLE = """<style>
.md-grid:has(.annotated) { max-width: 100rem; }
.annotated { display: grid; grid-template-columns: minmax(16rem, 2fr) 3fr; gap: 0 1.2rem; }
.annotated .note { font-size: .72rem; padding: .5rem 0; border-top: 1px solid #eee;
  min-width: 0; overflow-wrap: anywhere; }
.annotated .note p { margin: 0 0 .6em; }
.annotated .note pre { margin: .4em 0; }
.annotated .code { border-top: 1px solid #eee; min-width: 0; }
.annotated .code pre { margin: 0; }
.annotated .code code { font-size: .62rem; padding: .4rem .6rem; overflow-x: auto; }
.annotated .ln { color: #999; user-select: none; display: inline-block; width: 2.6em; }
</style>"""


def page_html(path: str, source: str, back: str) -> str:
    """The article of one core file's page: a link back, then note | code rows."""
    colours = coloured_lines(source)
    rows = []
    for s in cut(source).sections:
        code = "\n".join(f'<span class="ln">{n}</span>{colours[n - 1]}' for n in s.code)
        rows.append(f'<div class="note">{note_html(s.note)}</div>'
                    f'<div class="code"><div class="highlight"><pre><code>{code}'
                    f'</code></pre></div></div>')
    return (f"{STYLE}<h1 id=\"source\"><code>{html.escape(path)}</code>, annotated</h1>"
            f'<p>The file as it is, its docstrings and comments beside the lines they explain '
            f'(a comment at the end of a line stays on its line). Part of the teaching core: '
            f'<a href="{back}">Reading the code</a>.</p>'
            f'<div class="annotated">{"".join(rows)}</div>')


def on_files(files, config, **kwargs):
    reading = (ROOT / "docs" / "reading.md").read_text()
    for path in core_files(reading):
        PAGES[page_of(path)] = path
        title = path.rsplit("/", 1)[-1]
        files.append(File.generated(config, page_of(path),
                                    content=f"---\nhide: [navigation, toc]\n---\n# {title}\n\n"
                                            f"{path}, annotated.\n"))
    return files


def on_page_content(content: str, page, **kwargs) -> str:
    """A generated page's body becomes the file, annotated, its TeX typeset as every page's
    is (the MathML hook has already run on this page: it runs first in mkdocs.yml)."""
    path = PAGES.get(page.file.src_uri)
    if path is None:
        return content
    depth = page.file.src_uri.count("/")
    body = page_html(path, (ROOT / path).read_text(), "../" * depth + "reading.html")
    return typeset(body, page)
