"""MkDocs hook: the pages' TeX becomes MathML when the site is built, so no script and no
network is needed to show it (browsers draw MathML Core themselves).

pymdownx.arithmatex (generic mode) finds the math, outside code, and leaves it as
``<span class="arithmatex">\\(x\\)</span>`` inline or ``<div class="arithmatex">\\[x\\]</div>``
for display; this hook replaces each with latex2mathml's ``<math>`` element. A formula
latex2mathml cannot read fails the build.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
BLOCK = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.S)


def mathml(tex: str, display: str, where: str) -> str:
    try:
        return convert(html.unescape(tex).strip(), display=display)
    except Exception as e:  # latex2mathml raises its own exception types
        raise ValueError(f"{where}: cannot convert math {tex!r}: {e}") from e


def on_page_content(content: str, page, **kwargs) -> str:
    where = page.file.src_uri
    content = BLOCK.sub(lambda m: mathml(m.group(1), "block", where), content)
    return INLINE.sub(lambda m: mathml(m.group(1), "inline", where), content)
