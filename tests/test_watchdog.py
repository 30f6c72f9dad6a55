"""No hang ever (refmp.distributed.watchdog, recorder, diagnose, preemption).

The hangs run the real command under mpiexec with --collective-timeout 3 and a fault hook
(REFMP_FAULT_MODE): each must end non-zero (5) well within the timeout plus 30 s, naming the
stuck rank. They mostly wait, so they run at the same time (one fixture). The preemption
runs send SIGTERM to mpiexec and resume from the checkpoint: bitwise the run nobody stopped.
"""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from mpi_helpers import REPO, mpiexec, refmp

from refmp.cli.trace import read_states
from refmp.distributed.diagnose import report
from refmp.distributed.preemption import parse_signals
from refmp.distributed.recorder import Recorder
from refmp.errors import ConfigError

pytestmark = pytest.mark.cli

SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "8", "--batch-size", "8", "--no-progress"]
TIMEOUT = 3


def hang_cases() -> dict:
    """name: (ranks, train flags, fault environment); tutorial 16 runs the 2-rank hangs."""
    hang = {"REFMP_FAULT_RANK": "1", "REFMP_FAULT_STEP": "3", "REFMP_FAULT_MODE": "hang"}
    return {
        "tutorial 16": (0, [], None),  # dp 2 asleep outside MPI, pp 2 stuck in a receive
        "pp2 x dp2 hang": (4, ["--pp", "2", "--dp", "2", "--microbatches", "2"], hang),
        "mpi error": (2, ["--dp", "2"], {**hang, "REFMP_FAULT_MODE": "mpi"}),
        "mismatch": (2, ["sizes"], None),
        "mismatch checked": (2, ["ops"], {"REFMP_CHECK_CALLS": "1"}),
    }


@pytest.fixture(scope="module")
def hangs():
    cases = hang_cases()

    def one(name):
        n, flags, env = cases[name]
        t0 = time.perf_counter()
        if name == "tutorial 16":  # it launches its jobs itself, with mpiexec
            r = subprocess.run([sys.executable, "tutorials/16_hangs.py"], cwd=REPO,
                               capture_output=True, text=True, timeout=150)
        elif name.startswith("mismatch"):
            r = mpiexec(n, ["python", "tests/mpi_scripts/mismatched_collective.py", *flags],
                        timeout=60, env=env)
        else:  # "mpi error" runs with the default timeout: the abort must not wait for it
            timeout = [] if name == "mpi error" else ["--collective-timeout", str(TIMEOUT)]
            r = refmp(n, ["train", *SMALL, "--steps", "100000", *timeout, *flags], timeout=60,
                      env=env)
        return name, (r, time.perf_counter() - t0)

    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(pool.map(one, cases))


def ended_by_watchdog(r, seconds):
    assert r.returncode == 5, (r.returncode, r.stderr[-3000:])
    assert seconds < TIMEOUT + 30
    assert "refmp: the watchdog ends the job" in r.stderr
    assert "Thread 0x" in r.stderr  # the ranks' tracebacks (faulthandler)


def test_tutorial_16_rank_sleeping_outside_mpi_is_named_dp2(hangs):
    """The tutorial's jobs end with the watchdog's status 5 within the timeout plus 30 s (it
    checks that itself); its report, rank 1's traceback and `refmp trace` name rank 1."""
    r, _ = hangs["tutorial 16"]
    assert r.returncode == 0 and "OK: the watchdog named the stuck rank" in r.stdout, \
        r.stdout[-3000:] + r.stderr[-2000:]
    part1, part2, part3 = ("\n" + r.stdout).split("\nPart ")[1:4]
    assert part1.count("exit status 5 after") == 1 and "faults.py" in part1
    assert "rank 1 has not entered allreduce@dp #" in part1 and "that rank 0 waits in" in part1
    assert "rank 1 is not in MPI" in part1 and "in inject_fault" in part1  # its main thread
    trace = part2.split("--last 3:")[1]  # the same findings again, from the files
    assert "rank 1 has not entered allreduce@dp #" in trace and "rank 1 is not in MPI" in trace


def test_rank_sleeping_outside_mpi_is_named_pp_dp(hangs):
    r, seconds = hangs["pp2 x dp2 hang"]
    ended_by_watchdog(r, seconds)
    assert "rank 1 has not" in r.stderr and "rank 1 is not in MPI" in r.stderr, r.stderr[-3000:]


def test_tutorial_16_receive_that_never_gets_its_message(hangs):
    r, _ = hangs["tutorial 16"]
    part3 = ("\n" + r.stdout).split("\nPart ")[3]
    assert "exit status 5 after" in part3, r.stdout[-3000:]
    assert "rank 0 has not sent message #1 (tag 32766) on pp that rank 1 waits for in recv" \
        in part3 and "rank 1 waits in recv@pp #1 from rank 0 tag 32766" in part3, part3


def test_mpi_error_on_one_rank_ends_the_job_at_once(hangs):
    """An MPI error on rank 1 (REFMP_FAULT_MODE=mpi) while rank 0 waits in the all-reduce:
    its traceback, then MPI_Abort, long before the default --collective-timeout (300 s)."""
    r, seconds = hangs["mpi error"]
    assert r.returncode == 1 and seconds < 30, (r.returncode, seconds, r.stderr[-3000:])
    assert "[rank 1] mpi4py.MPI.Exception: Invalid rank" in r.stderr
    assert "[rank 1] refmp: aborting the job (MPI_Abort)" in r.stderr


def test_mismatched_collective_reports_both_calls(hangs):
    r, seconds = hangs["mismatch"]
    ended_by_watchdog(r, seconds)
    line = next(x for x in r.stderr.splitlines() if "mismatched calls on world[0,1] #1" in x)
    assert "allreduce 32 B float64" in line and "allreduce 8000 B float64" in line, line
    assert "not reached" not in r.stdout


def test_mismatched_ops_refused_with_the_check(hangs):
    """REFMP_CHECK_CALLS=1: an all-reduce against an all-gather of as many bytes (which MPICH
    completes with wrong values) is an error on both ranks, naming both calls."""
    r, seconds = hangs["mismatch checked"]
    assert r.returncode != 0 and seconds < 30 and "not reached" not in r.stdout
    # Both ranks write the traceback to one stderr, so lines of the two may interleave: one
    # whole line naming both calls is what the check must print.
    assert any("MismatchedCalls: mismatched calls on world[0,1] #1: rank 0 allreduce 32 B "
               "float64 at mismatched_collective.py:" in x and "rank 1 allgather 32 B float64" in x
               for x in r.stderr.splitlines()), r.stderr[-3000:]


def test_recorder_counts_and_report():
    """Sequence numbers per group and per (peer, tag); the analysis of two made-up states."""
    rec = Recorder(capacity=3)
    g = rec.group("dp", (0, 1))
    assert rec.group("dp", (0, 1)) == 1 and rec.group_name(1) == "dp~2[0,1]"
    for _ in range(4):
        rec.done(rec.start(g, "allreduce", 16, np.dtype("float32")))
    e = rec.start(g, "allreduce", 16, np.dtype("float32"))
    s = rec.start(g, "send", 8, np.dtype("float32"), 1, 7)
    assert (e[3], s[3], len(rec.ring)) == (5, 1, 3)  # the ring keeps the last 3
    mine = {**rec.dump(), "rank": 0, "time": e[11] + 10.0, "stack": []}
    other = Recorder()
    other.group("dp", (0, 1))
    for _ in range(4):
        other.done(other.start(0, "allreduce", 16, np.dtype("float32")))
    theirs = {**other.dump(), "rank": 1, "time": e[11] + 10.0, "stack": [["x.py", 3, "f"]]}
    text = report({0: mine, 1: theirs}, 2)
    assert "rank 1 has not entered allreduce@dp #5 that rank 0 waits in" in text, text
    assert "rank 1 is not in MPI" in text and "x.py:3 f" in text


def test_a_rank_left_waiting_in_a_collective_the_others_completed():
    """An all-to-all-v whose counts disagree: rank 1 waits for rows rank 0 never sends, while
    rank 0 has completed the call and gone on outside MPI."""
    states = {}
    for r in (0, 1):
        rec = Recorder()
        g = rec.group("ep", (0, 1))
        rec.done(rec.start(g, "alltoall", 16, np.dtype("int64")))
        e = rec.start(g, "alltoallv", 64, np.dtype("float64"))
        if r == 0:
            rec.done(e)
        else:
            rec.waiting = e  # as Comm's wait marks it
        states[r] = {**rec.dump(), "rank": r, "time": e[11] + 20.0, "stack": [["t.py", 9, "f"]]}
    text = report(states, 2)
    assert "rank 1 waits in alltoallv@ep #2, which rank 0 has completed: their counts or sizes " \
           "disagree with rank 1's" in text, text
    assert "rank 0 is not in MPI" in text and "rank 1 waits in alltoallv@ep #2 for" in text, text


def test_recorder_off_and_its_refusals(monkeypatch):
    """REFMP_RECORDER_CALLS=0 (what docs/faults.md's overhead measurement compares against):
    calls recorded as nothing; the watchdog refuses to run on it; bad values are refused;
    --trace-dir without the watchdog is refused, not dropped."""
    from refmp.distributed.recorder import ring_size
    from refmp.distributed.watchdog import Watchdog
    from refmp.training.checks import check_outputs
    from refmp.training.trainer import TrainConfig

    monkeypatch.setenv("REFMP_RECORDER_CALLS", "0")
    rec = Recorder()
    g = rec.group("dp", (0, 1))
    rec.done(rec.start(g, "allreduce", 16, np.dtype("float32")))
    assert not rec.on and rec.calls == 0 and not rec.ring and not rec.counts
    with pytest.raises(ConfigError, match="give --collective-timeout 0 too"):
        Watchdog(None, rec, 3.0, None)
    for bad in ("-1", "1e3", "many"):
        monkeypatch.setenv("REFMP_RECORDER_CALLS", bad)
        with pytest.raises(ConfigError, match="REFMP_RECORDER_CALLS must be a whole number"):
            ring_size()
    monkeypatch.setenv("REFMP_RECORDER_CALLS", "7")
    assert Recorder().ring.maxlen == 7
    with pytest.raises(ConfigError, match="--trace-dir holds the watchdog's report"):
        check_outputs(TrainConfig(collective_timeout=0.0, trace_dir="x"))


def test_exit_signal_names():
    assert [s.name for s in parse_signals("SIGTERM,usr1")] == ["SIGTERM", "SIGUSR1"]
    assert parse_signals("none") == []
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(ConfigError, match="--exit-signal"):
            parse_signals(bad)


def test_trace_reads_directories(tmp_path):
    with pytest.raises(ConfigError, match="no rank"):
        read_states([str(tmp_path)])


def _sigterm_then_resume(tmp_path, n, layout):
    """Train; SIGTERM to mpiexec mid-run, again every 5 ms until the save is over (so that
    later ones land in the agreement and the save); resume. (Not during the ranks' exit:
    mpiexec itself may then fail, status 255, the checkpoint complete.)"""
    from safetensors.numpy import load_file

    run = [*SMALL, *layout, "--steps", "30", "--dtype", "float64"]
    whole, resumed, ck = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "ck"
    log = tmp_path / "log.jsonl"
    cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "refmp", "train", *run,
           "--checkpoint-dir", str(ck), "--save-every", "5", "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (ck / "step-00000005" / "manifest.json").exists():
            time.sleep(0.01)  # training runs (the log is buffered: a checkpoint says so)
        assert job.poll() is None, "the job ended before the signal"
        t0 = time.perf_counter()
        while job.poll() is None and time.perf_counter() - t0 < 30 and "preempted" not in \
                log.read_text():  # rank 0 closes the log after the save: some land in it
            job.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        out, err = job.communicate(timeout=30)
        assert time.perf_counter() - t0 < 30
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 4, (job.returncode, err)
    last = log.read_text().splitlines()[-1]
    step = int(last.split('"step": ')[1].rstrip("}"))
    assert '"preempted": "SIGTERM"' in last and 5 <= step < 30
    assert f"refmp train: stopped by SIGTERM after step {step} of 30; checkpoint of step {step}" in err
    assert (ck / f"step-{step:08d}" / "manifest.json").exists()
    assert refmp(n, ["train", *run, "--save", str(whole)], timeout=120).returncode == 0
    r = refmp(n, ["train", *run, "--resume", str(ck), "--save", str(resumed)], timeout=120)
    assert r.returncode == 0 and f"at step {step} of 30" in r.stdout, r.stderr
    a, b = load_file(str(whole)), load_file(str(resumed))
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def test_sigterm_checkpoints_and_resumes_bitwise_dp(tmp_path):
    _sigterm_then_resume(tmp_path, 2, ["--dp", "2"])


def test_sigterm_checkpoints_and_resumes_bitwise_pp_tp(tmp_path):
    _sigterm_then_resume(tmp_path, 4, ["--pp", "2", "--tp", "2", "--microbatches", "2"])


def test_sigterm_to_one_rank_without_checkpoint_dir_stops_every_rank(tmp_path):
    """SIGTERM to rank 1 alone (not the launcher): rank 0, which got none, stops at the same
    step boundary and says so, since the ranks agree on the flag; no --checkpoint-dir."""
    log = tmp_path / "log.jsonl"
    job = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", *SMALL,
                            "--steps", "100000", "--log-json", str(log)], cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1",
                                "REFMP_TEST_PID_DIR": str(tmp_path)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # a flushed log means steps ran, so rank 1 catches the signal (not the banner:
        deadline = time.time() + 60  # rank 1 may not have installed its handler by then)
        while time.time() < deadline and not (log.exists() and log.stat().st_size):
            time.sleep(0.01)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 4 and "no --checkpoint-dir: nothing saved" in err, err
    assert '"preempted": "SIGTERM"' in log.read_text().splitlines()[-1]  # rank 0's log
