"""One mpiexec launch for all the parallel tests of a file that want the same number of ranks.

mpi-pytest runs each test marked ``parallel(nprocs=N)`` as its own ``mpiexec -n N pytest
file::test``: N new Python processes, each importing pytest, hypothesis, NumPy, mpi4py and the
test file, about half a second of CPU each, for tests that often take less than that to run.
On a 2-core machine those start-ups are most of what such tests cost.

So the parent pytest (the one you started) groups the parallel tests by (file, N) and, when
the first test of a group comes up, runs the whole group in one launch::

    mpiexec -n N python -m pytest file::test_a file::test_b[nprocs=N] ...

Each rank writes what pytest reports for every test (its start; pass, fail with its traceback
and captured output, skip) to a file of its own, a line per report, as it goes
(pytest_runtest_logstart, pytest_runtest_logreport).
Back in the parent, each test of the group then passes, fails or skips as its ranks say
(outcome): a failure shows each distinct failure text with the ranks that reported it.

A group runs in one Python process per rank, one test after the other, as a file would
under ``mpiexec -n N pytest file``; mpi-pytest's barrier after each test keeps the ranks in
step. What a test leaves behind, the next one sees: MPICH gives a process about 2,000
communicators, and every ProcessGrid makes some (the largest group today leaves 1,770 free;
a test that makes grids by the hundred frees them, as tests/test_tensor_parallel.py does).
One test alone (``pytest file::test``) is a group of one: the same launch mpi-pytest makes.
With ``pytest -s`` the ranks print as they run; ``--durations`` gives the first test of a
group the time of the whole launch.

A hang ends the launch, and costs one test. Under mpiexec, pytest-timeout's timer is
replaced by refmp's watchdog (refmp.distributed.watchdog), one per test on every rank, over a
flight recorder that every grid of the test records into (refmp.distributed.recorder.install).
It fires when a rank has made no progress for ``COLLECTIVE_TIMEOUT_S`` (no communication call
started or completed), or when the test has run past its limit (limit_of: its ``timeout``
marker, else ``--timeout``, else ``TEST_LIMIT_S``; set-up to tear-down); every rank then writes its
state to the launch's side channel and the watchdog ends the launch with MPI_Abort. (A timer
that failed the test on one rank alone would send that rank on to the next test while its
peers still wait in the old one.) The parent reports the test that was running as failed
with the watchdog's findings (which rank has not entered which call the others wait in), each
rank's last calls and Python stack, and launches the tests after it again. A launch that
ends early for another reason (a crash) is handled the same way, without the findings. The
parent ends a launch whose ranks have written nothing for ``SLACK_S`` past the longest
limit of its tests (their watchdogs could not fire).
"""

from __future__ import annotations

import json
import linecache
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CHILD = "_PYTEST_MPI_CHILD_PROCESS"  # mpi-pytest's flag: "already under mpiexec, just run"
REPORTS = "REFMP_MPI_REPORTS"  # the directory each rank of a launch writes its reports to
COLLECTIVE_TIMEOUT = "REFMP_TEST_COLLECTIVE_TIMEOUT"  # overrides COLLECTIVE_TIMEOUT_S
TEST_LIMIT_S = 60  # a parallel test's time limit, set-up to tear-down, without a marker
COLLECTIVE_TIMEOUT_S = 15  # a rank without progress for this long: a hang (tests/README.md)
SLACK_S = 60  # a launch's start-up and shut-down, on top of its tests' limits
LAST_CALLS = 6  # of each rank's flight recorder, in the report of a hang

_group_of: dict[str, tuple] = {}  # nodeid -> (file, N)
_groups: dict[tuple, list] = {}  # (file, N) -> its items, in the order they run
_runs: dict[tuple, dict] = {}  # (file, N) -> {nodeid: the launch that ran it (launch())}


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


def collective_timeout() -> float:
    """COLLECTIVE_TIMEOUT_S, or the environment's REFMP_TEST_COLLECTIVE_TIMEOUT."""
    return float(os.environ.get(COLLECTIVE_TIMEOUT, COLLECTIVE_TIMEOUT_S))


def limit_of(item) -> float:
    """A test's limit under mpiexec: its ``timeout`` marker, else ``--timeout`` as given on
    the command line, else TEST_LIMIT_S (not the ini's 300 s)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getoption("timeout") or TEST_LIMIT_S)


# --- in the parent: group, launch, report --------------------------------------------------


def pytest_collection_finish(session) -> None:
    if not in_parent():
        return
    _group_of.clear()
    _groups.clear()
    _runs.clear()
    for item in session.items:
        n = nprocs(item)
        if n > 1:
            key = (str(item.path), n)
            _group_of[item.nodeid] = key
            _groups.setdefault(key, []).append(item)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    key = _group_of.get(pyfuncitem.nodeid)
    if key is None:
        return None  # a serial test, or already under mpiexec: run it as it is
    if key not in _runs:
        _runs[key] = run_group(pyfuncitem.config, key)
    launched = _runs[key][pyfuncitem.nodeid]
    outcome(pyfuncitem.nodeid, launched)
    if pyfuncitem is _groups[key][-1] and launched["why"] and not any(
            x["outcome"] == "failed" for reps in launched["ranks"].values() for x in reps):
        # as mpi-pytest: a launch that fails after its tests passed (a rank's exit) fails
        pytest.fail(f"every test passed, but {launched['why']}", pytrace=False)
    return True


def run_group(config, key: tuple) -> dict[str, dict]:
    """Run the group's tests: {nodeid: the launch that ran it}. A launch that ended during a
    test (the watchdog, a crash) leaves that test to be reported from it, and the tests it
    did not reach are launched again; a test none of the launches reached (one that failed
    before any test began) is reported from the last."""
    todo, ran = [item.nodeid for item in _groups[key]], {}
    while todo:
        launched = launch(config, todo, key[1])
        started = {x["nodeid"] for reps in launched["ranks"].values() for x in reps}
        ran.update((nodeid, launched) for nodeid in todo)
        cut_short = [t for t in todo if t in started and not finished(t, launched)]
        if not (launched["why"] and cut_short):
            break
        todo = [t for t in todo if t not in started]
    return ran


def finished(nodeid: str, launched: dict) -> bool:
    """Every rank reported the test's tear-down."""
    return all(any(x["nodeid"] == nodeid and x["when"] == "teardown" for x in reps)
               for reps in launched["ranks"].values()) and len(launched["ranks"]) == launched["n"]


def launch(config, nodeids: list[str], n: int) -> dict:
    """Run ``nodeids`` under one ``mpiexec -n n``: {"ranks": {rank: its reports}, "why": what
    went wrong with the launch itself ("" if nothing), "n": n}."""
    items = [item for item in _groups[_group_of[nodeids[0]]] if item.nodeid in nodeids]
    with tempfile.TemporaryDirectory(prefix="refmp-mpi-") as d:
        live = config.getoption("capture") == "no"  # pytest -s: the ranks print as they go
        cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "pytest", "-q", "--runxfail",
               "-p", "no:cacheprovider", *(["-s"] if live else []),
               "--timeout", str(config.getoption("timeout") or TEST_LIMIT_S), *nodeids]
        env = {**os.environ, CHILD: "1", REPORTS: d}
        quiet_s = max(map(limit_of, items)) + SLACK_S
        with open(os.path.join(d, "output"), "w+") as out:
            job = subprocess.Popen(cmd, cwd=config.rootpath, env=env, text=True,
                                   stdout=None if live else out,
                                   stderr=None if live else subprocess.STDOUT,
                                   start_new_session=True)  # its own group: ended as one
            ended = wait_for(job, d, quiet_s)
            out.seek(0)
            output = out.read()
        why = ""
        if job.returncode != 0:
            why = ended or f"mpiexec exited with {job.returncode}"
            hang = watchdog_report(os.path.join(d, "watchdog"), n, config.rootpath)
            if hang:
                why += f": the watchdog ended the launch during this test.\n{hang}"
            elif not live:
                why += f":\n{tail(output)}"
        ranks = {}
        for path in Path(d).glob("rank*.jsonl"):
            lines = path.read_text().splitlines()
            ranks[int(path.stem[4:])] = [json.loads(x) for x in lines if x.strip()]
    return {"ranks": ranks, "why": why, "n": n}


def wait_for(job: subprocess.Popen, d: str, quiet_s: float) -> str:
    """Wait for the launch to end; end it (every process of it) when no rank has written a
    report for ``quiet_s`` seconds. Returns why it was ended, "" if it ended by itself."""
    last = time.time()
    while True:
        try:
            job.wait(timeout=1.0)
            return ""
        except subprocess.TimeoutExpired:
            pass
        last = max([last, *(p.stat().st_mtime for p in Path(d).glob("rank*.jsonl"))])
        if time.time() - last > quiet_s:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            return f"no rank reported for {quiet_s:.0f} s, and the launch was ended"


def watchdog_report(folder: str, n: int, root) -> str:
    """What the watchdog found, from what the ranks wrote to ``folder``: who fired and why
    (the alarm), its table and findings, and each rank's last calls and Python stack. ""
    if it did not fire."""
    from refmp.cli.trace import read_states
    from refmp.distributed.diagnose import last_calls, report
    from refmp.distributed.watchdog import ALARM

    alarm = Path(folder, ALARM)
    if not alarm.exists():
        return ""
    states = read_states([folder]) if any(Path(folder).glob("rank*.json")) else {}
    lines = [f"watchdog of {alarm.read_text().strip()}", report(states, n)]
    for r, st in sorted(states.items()):
        lines += last_calls(st, LAST_CALLS)
        lines += [f"rank {r}'s Python stack, innermost last:", *stack(st["stack"], root)]
    return "\n".join(lines)


def stack(frames: list, root) -> list[str]:
    """The frames in the repository (the test's and refmp's), with their source lines, "..."
    where others (pytest's, hypothesis') come between; the last few if none is (a rank in
    pytest's own code, as in mpi-pytest's barrier after a test)."""
    root = str(root)
    ours = [i for i, f in enumerate(frames) if f[0].startswith(root)
            and "site-packages" not in f[0]]
    out, last = [], None
    for i in ours or range(max(len(frames) - 4, 0), len(frames)):
        file, line, name = frames[i]
        if last is not None and i > last + 1:
            out.append("  ...")
        code = linecache.getline(file, line).strip()
        out.append(f"  {os.path.relpath(file, root)}:{line} {name}: {code}")
        last = i
    return out


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
    texts = [f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {text}"
             for text, rs in failed.items()] + output
    if missing:
        began = any(x["when"] == "start" for reps in of_test.values() for x in reps)
        texts.append(f"ranks {missing} did not finish this test{'' if began else ' (not reached)'}"
                     f": {launched['why']}")
    if texts:
        pytest.fail("\n\n".join(texts), pytrace=False)
    skips = [x for x in of_test.get(0, []) if x["outcome"] == "skipped"]
    if skips:
        pytest.skip(skips[0]["text"].removeprefix("Skipped: "))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's timer: none for a grouped test in the parent (its launch keeps the
    limits), refmp's watchdog under mpiexec (below), pytest-timeout's own for the others."""
    if item.nodeid in _group_of:
        return True
    if CHILD not in os.environ or REPORTS not in os.environ:
        return None
    item.stash[_WATCHDOG] = watch(settings.timeout)
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    """Nothing to cancel in the parent; under mpiexec the watchdog stops at the end of the
    test's protocol (pytest_runtest_protocol), not here: pytest-timeout also cancels when a
    test fails (pytest_exception_interact), while the other ranks may still be in it."""
    if item.nodeid in _group_of or (CHILD in os.environ and REPORTS in os.environ):
        return True
    return None


# --- under mpiexec: each rank watches each test and writes its reports ---------------------

_WATCHDOG = pytest.StashKey()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    watchdog = item.stash.get(_WATCHDOG, None)
    if watchdog is not None:
        del item.stash[_WATCHDOG]
        unwatch(watchdog)


def watch(limit: float):
    """Start this rank's watchdog for one test (collective over the world): a fresh flight
    recorder that every grid the test makes records into, the side channel in the launch's
    reports directory."""
    from mpi4py import MPI

    from refmp.distributed import recorder
    from refmp.distributed.watchdog import Watchdog

    rec = recorder.Recorder()
    recorder.install(rec)
    folder = os.path.join(os.environ[REPORTS], "watchdog")
    return Watchdog(MPI.COMM_WORLD, rec, collective_timeout(), folder, limit=limit).start()


def unwatch(watchdog) -> None:
    from refmp.distributed import recorder

    watchdog.stop()
    recorder.install(None)


def write_report(line: dict) -> None:
    d = os.environ.get(REPORTS)
    if d is None or CHILD not in os.environ:
        return
    from mpi4py import MPI

    with open(os.path.join(d, f"rank{MPI.COMM_WORLD.rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    write_report({"nodeid": nodeid, "when": "start", "outcome": "", "text": "", "output": []})


def pytest_runtest_logreport(report) -> None:
    text, output = "", []
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]  # (file, line, reason)
    elif report.outcome == "failed":
        text, output = report.longreprtext, report.sections  # the captured output
    write_report({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                  "text": text, "output": output})
