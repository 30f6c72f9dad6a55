"""The package's layout holds: imports go down the layers, no module is too long and each one
near the cap names where it would split, no statement packs several attributes into one line,
the cost model is pure, at most six modules sit directly in refmp/ (docs/architecture.md)."""

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
            # ``from refmp.x import y``: the module refmp.x.y where y is one, else refmp.x
            base = ROOT.joinpath(*node.module.split("."))
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (base / f"{a.name}.py").is_file() or (base / a.name).is_dir()}
            out |= subs or {node.module}
            if len(subs) < len(node.names):
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


CAP = 400  # no module is longer
NEAR = 300  # a module longer than this names its seam in SEAMS

# Every module over NEAR lines, and where it splits when it grows: the first function or class
# that would move (``Class.method`` for a method) and where it would go. A module that nears
# CAP is split along its seam, never packed to fit (no statement assigns several attributes:
# test_no_statement_assigns_several_attributes). Keep this table to exactly the modules over
# NEAR; the test's message says which entry to add, fix or remove.
SEAMS = {
    "refmp/cost/memory.py": ("grads_at_once", "what a rank holds for a moment beside its state "
                                              "(grads_at_once, setup_bytes) into "
                                              "cost/transient.py"),
    "refmp/cost/model.py": ("Impl", "what the timed implementation does beyond the layout "
                                    "(Impl and its presets) into cost/impls.py; Layout and "
                                    "predict stay"),
    "refmp/config.py": ("check_sizes", "the checks of a run's flags (check_sizes, "
                                       "check_config) into config_checks.py; the flags and "
                                       "the configs stay"),
    "refmp/parallel/data/sharder.py": ("Sharder.master_grads", "mixed precision's fp32 masters "
                                                               "(master_grads, after_step's "
                                                               "rounding) into data/masters.py"),
    "refmp/cli/netns.py": ("leftovers", "finding and removing what a killed cluster left "
                                        "(stop_processes, leftovers, clean) into "
                                        "cli/netns_clean.py"),
    "refmp/parallel/placement.py": ("tp_shard", "slicing a parameter and gluing it back "
                                                "(tp_shard, tp_unshard, gather_tp, gather_etp, "
                                                "gather_experts) into parallel/glue.py"),
    "refmp/parallel/engine.py": ("Engine.piece_index", "gathering the whole model (piece_index, "
                                                       "full_params, full_grads, _whole) into "
                                                       "parallel/gather.py"),
}


def lines_of(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def defines(path: pathlib.Path, name: str) -> bool:
    """Whether ``path`` defines function or class ``name`` (``Class.method`` for a method)."""
    body = ast.parse(path.read_text()).body
    *outer, last = name.split(".")
    for part in outer:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == part), [])
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and n.name == last for n in body)


def test_no_module_is_too_long_and_each_one_near_the_cap_names_its_seam():
    sizes = {str(p.relative_to(ROOT)): lines_of(p) for p in modules()}
    wrong = []
    for module, n in sorted(sizes.items()):
        if n > CAP:
            name, goes = SEAMS.get(module, ("a seam", "name it in SEAMS if a part stays long"))
            wrong.append(f"{module} has {n} lines, over {CAP}: split it at {name} ({goes}); "
                         "never pack lines to fit")
        elif n > NEAR and module not in SEAMS:
            wrong.append(f"{module} has {n} lines, over {NEAR}: add to SEAMS in "
                         f"tests/test_structure.py {module!r}: (\"<the first def, class or "
                         "Class.method that would move>\", \"<where it would go>\")")
    for module, (name, _) in sorted(SEAMS.items()):
        if module not in sizes:
            wrong.append(f"SEAMS names {module}, which does not exist: remove its entry "
                         "(or give the module's new path)")
        elif sizes[module] <= NEAR:
            wrong.append(f"{module} has {sizes[module]} lines, not over {NEAR}: remove its "
                         "entry from SEAMS in tests/test_structure.py")
        elif not defines(ROOT / module, name):
            wrong.append(f"SEAMS splits {module} at {name}, which it does not define: name the "
                         "def, class or Class.method where it would split now")
    assert not wrong, "\n".join(wrong)


def test_few_modules_sit_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 6, f"modules directly in refmp/: {top}"


# Statements that may assign several attributes at once: one value unpacked into its genuine
# parts (``self.m, self.v = adam_moments(g)``), keyed by module and the targets as ast.unparse
# writes them: ("refmp/training/optim.py", "self.m, self.v"). Keep it tiny.
GENUINE_PAIRS: set[tuple[str, str]] = set()


def attributes_assigned(node: ast.Assign) -> list[str]:
    """The attributes one assignment sets: ``self.a, self.b = ...``, ``a.x = a.y = ...``, and
    attributes nested in tuples, lists or starred targets."""
    out, todo = [], list(node.targets)
    while todo:
        t = todo.pop(0)
        if isinstance(t, ast.Attribute):
            out.append(ast.unparse(t))
        elif isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
    return out


def test_no_statement_assigns_several_attributes():
    """One statement per line for unrelated state: ``self.a, self.b = x, y`` packed to keep a
    module short is what SEAMS replaces (a module near the cap splits along its seam)."""
    found, packed = set(), []
    for path in modules():
        module = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and len(attrs := attributes_assigned(node)) >= 2:
                targets = " = ".join(", ".join(map(ast.unparse, t.elts))
                                     if isinstance(t, ast.Tuple) else ast.unparse(t)
                                     for t in node.targets)
                if (module, targets) in GENUINE_PAIRS:
                    found.add((module, targets))
                else:
                    call = len(node.targets) == 1 and isinstance(node.value, ast.Call)
                    hint = f"; if a genuine pair: {(module, targets)!r}" if call else ""
                    packed.append(f"{module}:{node.lineno}: {targets} = ... "
                                  f"({len(attrs)} attributes{hint})")
    stale = sorted(GENUINE_PAIRS - found)
    assert not packed, ("split each into one statement per attribute, one per line (only a "
                        "genuine pair, one value unpacked into its parts, may instead be added "
                        "to GENUINE_PAIRS in tests/test_structure.py):\n" + "\n".join(packed))
    assert not stale, f"GENUINE_PAIRS entries that no longer occur: remove them: {stale}"


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


def core_files() -> list[str]:
    """The teaching core, as docs/reading.md's table lists it (docs/reading_counts.py)."""
    import runpy

    counts = runpy.run_path(str(ROOT / "docs" / "reading_counts.py"))
    return list(counts["listed"]((ROOT / "docs" / "reading.md").read_text()))


BELOW_THE_CORE = ("runtime", "distributed", "nn", "config", "errors")  # what the core stands on


def test_the_core_imports_no_engine_file():
    """docs/reading.md's promise: the engine sits on top of the core, never inside it. A core
    file imports other core files and the layers below (runtime/, distributed/, nn/, config,
    errors), never another module of parallel/ or anything above."""
    core = {dotted_of(ROOT / f) for f in core_files()}
    wrong = []
    for me in sorted(core):
        for dep in sorted(imports_of(ROOT / (me.replace(".", "/") + ".py"))):
            if dep not in core and package_of(dep) not in BELOW_THE_CORE:
                wrong.append(f"{me} imports {dep}")
    assert not wrong, ("core files that import the engine (move what they take down beside "
                       "the core, or hand it in): " + "; ".join(wrong))


def test_the_package_has_no_import_circle():
    """No module reaches, through the modules it imports (at the top or inside a function),
    back to itself."""
    graph = {dotted_of(p): set() for p in modules()}
    for path in modules():
        for dep in imports_of(path):
            graph[dotted_of(path)].add(dep)
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    circles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(circles)
