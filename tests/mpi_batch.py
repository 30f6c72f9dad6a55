"""One mpiexec launch for all the parallel tests of a file that want the same number of ranks.

mpi-pytest runs each test marked ``parallel(nprocs=N)`` as its own ``mpiexec -n N pytest
file::test``: N new Python processes, each importing pytest, hypothesis, NumPy, mpi4py and the
test file, about half a second of CPU each, for tests that often take less than that to run.
On a 2-core machine those start-ups are most of what such tests cost.

So the parent pytest (the one you started) groups the parallel tests by (file, N) and, when
the first test of a group comes up, runs the whole group in one launch::

    mpiexec -n N python -m pytest file::test_a file::test_b[nprocs=N] ...

Each rank writes what pytest reports for every test (pass, fail with its traceback and
captured output, skip) to a file of its own, a line per report, as it goes
(pytest_runtest_logreport).
Back in the parent, each test of the group then passes, fails or skips as its ranks say
(outcome): a failure shows each distinct failure text with the ranks that reported it; a
test the launch never reached (a crash, MPI_Abort, the time limit) fails, naming why.

A group runs in one Python process per rank, one test after the other, as a file would
under ``mpiexec -n N pytest file``; mpi-pytest's barrier after each test keeps the ranks in
step. Its time limit is the sum of its tests' (each test keeps its own within the launch).
What a test leaves behind, the next one sees: MPICH gives a process about 2,000
communicators, and every ProcessGrid makes some (the largest group today leaves 1,770 free;
a test that makes grids by the hundred frees them, as tests/test_tensor_parallel.py does).
One test alone (``pytest file::test``) is a group of one: the same launch mpi-pytest makes.
With ``pytest -s`` the ranks print as they run; ``--durations`` gives the first test of a
group the time of the whole launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CHILD = "_PYTEST_MPI_CHILD_PROCESS"  # mpi-pytest's flag: "already under mpiexec, just run"
REPORTS = "REFMP_MPI_REPORTS"  # the directory each rank of a launch writes its reports to
SLACK_S = 60  # a launch's start-up and shut-down, on top of its tests' time limits

_group_of: dict[str, tuple] = {}  # nodeid -> (file, N)
_groups: dict[tuple, list] = {}  # (file, N) -> its items, in the order they run
_reports: dict[tuple, dict] = {}  # (file, N) -> what launch() returns


def nprocs(item) -> int:
    """The ranks a test wants (mpi-pytest's marker: an int, or a list split into
    [nprocs=N] copies by mpi-pytest); 1 for a serial test."""
    marker = item.get_closest_marker("parallel")
    if marker is None:
        return 1
    if hasattr(item, "callspec") and "_nprocs" in item.callspec.params:
        return item.callspec.params["_nprocs"]
    n = marker.kwargs.get("nprocs", marker.args[0] if marker.args else 3)
    return n[0] if isinstance(n, (list, tuple)) else n


def in_parent() -> bool:
    from mpi4py import MPI

    return MPI.COMM_WORLD.size == 1 and CHILD not in os.environ


# --- in the parent: group, launch, report --------------------------------------------------


def pytest_collection_finish(session) -> None:
    if not in_parent():
        return
    _group_of.clear()
    _groups.clear()
    _reports.clear()
    for item in session.items:
        n = nprocs(item)
        if n > 1:
            key = (str(item.path), n)
            _group_of[item.nodeid] = key
            _groups.setdefault(key, []).append(item)
    limit = float(session.config.getini("timeout") or 0)
    for items in _groups.values():  # the first test of a group waits for the whole launch
        if limit:
            items[0].add_marker(pytest.mark.timeout(limit * len(items) + SLACK_S))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    key = _group_of.get(pyfuncitem.nodeid)
    if key is None:
        return None  # a serial test, or already under mpiexec: run it as it is
    if key not in _reports:
        _reports[key] = launch(pyfuncitem.config, key)
    launched = _reports[key]
    outcome(pyfuncitem.nodeid, launched)
    if pyfuncitem is _groups[key][-1] and launched["why"] and not any(
            x["outcome"] == "failed" for reps in launched["ranks"].values() for x in reps):
        # as mpi-pytest: a launch that fails after its tests passed (a rank's exit) fails
        pytest.fail(f"every test passed, but {launched['why']}", pytrace=False)
    return True


def launch(config, key: tuple) -> dict:
    """Run the group's tests under one ``mpiexec -n N``: {"ranks": {rank: its reports},
    "why": what went wrong with the launch itself ("" if nothing), "n": N}."""
    items, n = _groups[key], key[1]
    limit = float(config.getini("timeout") or 0)
    with tempfile.TemporaryDirectory(prefix="refmp-mpi-") as d:
        live = config.getoption("capture") == "no"  # pytest -s: the ranks print as they go
        cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "pytest", "-q", "--runxfail",
               "-p", "no:cacheprovider", *(["-s"] if live else []),
               *(item.nodeid for item in items)]
        env = {**os.environ, CHILD: "1", REPORTS: d}
        why = ""
        try:
            r = subprocess.run(cmd, cwd=config.rootpath, env=env, capture_output=not live,
                               text=True, timeout=limit * len(items) + SLACK_S if limit else None)
            if r.returncode != 0:
                out = "" if live else tail(r.stdout + r.stderr)
                why = f"mpiexec exited with {r.returncode}:\n{out}"
        except subprocess.TimeoutExpired as e:  # its output comes as bytes, even with text
            out = b"".join(x for x in (e.stdout, e.stderr) if x).decode(errors="replace")
            why = f"the launch ran past {e.timeout:.0f} s and was ended:\n{tail(out)}"
        ranks = {}
        for path in Path(d).glob("rank*.jsonl"):
            lines = path.read_text().splitlines()
            ranks[int(path.stem[4:])] = [json.loads(x) for x in lines if x.strip()]
    return {"ranks": ranks, "why": why, "n": n}


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def outcome(nodeid: str, launched: dict) -> None:
    """Pass, or fail / skip as the ranks reported (every rank must have run the test)."""
    of_test = {r: [x for x in reps if x["nodeid"] == nodeid]
            for r, reps in launched["ranks"].items()}
    missing = [r for r in range(launched["n"]) if not any(
        x["when"] == "teardown" for x in of_test.get(r, []))]
    failed: dict[str, list] = {}  # each distinct traceback once, with the ranks that raised it
    output = []
    for r in sorted(of_test):
        for x in of_test[r]:
            if x["outcome"] == "failed":
                failed.setdefault(f"({x['when']})\n{x['text']}", []).append(r)
                output += [f"--- rank {r}: {title} ---\n{body}" for title, body in x["output"]]
    if failed:
        pytest.fail("\n\n".join([f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {text}"
                                 for text, rs in failed.items()] + output), pytrace=False)
    if missing:
        pytest.fail(f"ranks {missing} did not finish this test: {launched['why']}",
                    pytrace=False)
    skips = [x for x in of_test.get(0, []) if x["outcome"] == "skipped"]
    if skips:
        pytest.skip(skips[0]["text"].removeprefix("Skipped: "))


# --- under mpiexec: each rank writes its reports -------------------------------------------


def pytest_runtest_logreport(report) -> None:
    d = os.environ.get(REPORTS)
    if d is None or CHILD not in os.environ:
        return
    from mpi4py import MPI

    text, output = "", []
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]  # (file, line, reason)
    elif report.outcome == "failed":
        text, output = report.longreprtext, report.sections  # the captured output
    line = json.dumps({"nodeid": report.nodeid, "when": report.when,
                       "outcome": report.outcome, "text": text, "output": output})
    with open(os.path.join(d, f"rank{MPI.COMM_WORLD.rank}.jsonl"), "a") as f:
        f.write(line + "\n")
