"""The package's layout holds: imports go down the layers, no module is too long, the cost
model is pure, at most six modules sit directly in refmp/ (docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "refmp"

# a module may import from its own package and from lower layers, never from its own layer's
# other packages or from above
LAYERS = {
    "errors": 0, "config": 0.5,
    "runtime": 1,
    "nn": 2, "distributed": 2,
    "parallel": 3,
    "checkpoint": 4, "cost": 4,
    "inference": 4.5,  # training's evaluation decodes with the inference Decoder
    "training": 5,
    "cli": 6, "__main__": 7, "__init__": 7,
}


def modules() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def package_of(dotted: str) -> str:
    """``refmp.parallel.data.sharder`` -> ``parallel``; ``refmp.config`` -> ``config``."""
    return dotted.split(".")[1] if dotted.count(".") else "__init__"


def dotted_of(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every refmp module this file imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("refmp")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("refmp"):
            out.add(node.module)
    return out


def test_imports_go_down_the_layers():
    wrong = []
    for path in modules():
        me = dotted_of(path)
        mine = package_of(me) if me != "refmp" else "__init__"
        for dep in imports_of(path):
            theirs = package_of(dep) if dep != "refmp" else "__init__"
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{me} imports {dep}")
    assert not wrong, "imports that do not go down: " + "; ".join(sorted(wrong))


def test_no_module_is_too_long_and_few_sit_at_the_top():
    long = [f"{p.relative_to(ROOT)} ({n})" for p in modules()
            if (n := len(p.read_text().splitlines())) > 350]
    assert not long, f"modules over 350 lines: {long}"
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 6, f"modules directly in refmp/: {top}"


def test_the_cost_model_is_pure():
    """Importing every cost module loads neither MPI nor the trainer."""
    names = [dotted_of(p) for p in (PKG / "cost").glob("*.py")]
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + "bad = [m for m in sys.modules if m == 'mpi4py' or m.startswith('refmp.training')]\n"
            + "assert not bad, bad\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_the_module_map_names_every_module():
    """docs/architecture.md's module map lists every module of the package."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PKG)) for p in modules()
               if p.name not in ("__init__.py", "__main__.py") and p.name not in page]
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
