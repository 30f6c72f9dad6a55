"""The optional libraries some tests compare with or read through: without one, its tests
skip, and the skip says which extra installs it and how (README, set-up)."""

from __future__ import annotations

HOW = {"hf": "pip install torch --index-url https://download.pytorch.org/whl/cpu; "
             "pip install -e '.[hf]'",
       "text": "pip install -e '.[text]'"}


def reason(module: str, extra: str) -> str:
    """The skip's reason: ``pytest.importorskip(module, reason=reason(module, extra))``."""
    return f"{module} is not installed: the {extra} extra ({HOW[extra]})"
