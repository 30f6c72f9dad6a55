"""Tutorial 16: a hang, found -- the watchdog's report and the flight recorders.

Run:  python tutorials/16_hangs.py        (it launches its two jobs with mpiexec)

A collective program hangs when one rank does not reach a call the others wait in. Two
jobs of `refmp train` are made to hang on purpose (the testing hook REFMP_FAULT_MODE,
docs/faults.md), both with --collective-timeout 3 --trace-dir DIR:
  1. dp 2: rank 1 sleeps forever before step 3, outside MPI, while rank 0 waits in the
     gradient all-reduce. The watchdog ends the job (status 5); its report, and where the
     stuck rank's main thread is (its faulthandler traceback);
  2. the flight recorders the ranks wrote, read by hand: each rank's count of calls on the
     dp group. MPI orders a group's collectives, so the rank whose count is behind has not
     entered the call the others wait in. Then `refmp trace DIR`: the same, from the files;
  3. pp 2: rank 1 receives a message rank 0 never sends. Counts per (peer, tag) say which
     message is missing; the two ranks wait for each other, and the frames say which wait
     is not the pipeline's.
Exit status 1 if a job does not end as the watchdog ends it, or names another rank.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

TIMEOUT = 3  # --collective-timeout: seconds without progress before the watchdog fires
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "8", "--batch-size", "8",
         "--steps", "100000", "--no-progress", "--collective-timeout", str(TIMEOUT)]
failures = []


def job(layout: list[str], mode: str, trace_dir: str) -> subprocess.Popen:
    """`mpiexec -n 2 refmp train` with rank 1 made to hang before step 3 (``mode``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFMP_FAULT_RANK": "1",
           "REFMP_FAULT_STEP": "3", "REFMP_FAULT_MODE": mode}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "refmp", "train", *SMALL, *layout,
           "--trace-dir", trace_dir]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def ended(p: subprocess.Popen, t0: float, what: str) -> str:
    """Wait for a job (60 s at most); its stderr. It must end with the watchdog's status 5."""
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        failures.append(f"{what}: still running after 60 s")
    seconds = time.perf_counter() - t0
    print(f"  the job ended with exit status {p.returncode} after {seconds:.1f} s "
          f"(--collective-timeout {TIMEOUT})")
    if p.returncode != 5 or seconds > TIMEOUT + 30:
        failures.append(f"{what}: status {p.returncode} after {seconds:.1f} s, not the watchdog's")
    return err


def report_lines(err: str) -> list[str]:
    """The leader's report: its lines from the table's header on (tracebacks come before)."""
    lines = err.splitlines()
    head = next((i for i, x in enumerate(lines) if x.endswith("waiting s  step  mb  where")), None)
    if head is None:
        failures.append("no report in the job's output")
        return []
    leader = lines[head].split("]")[0] + "]"
    return [x for x in lines[head:] if x.startswith(leader)]


def main_thread(err: str, rank: int) -> list[str]:
    """The innermost frames of ``rank``'s main thread, from its faulthandler traceback (the
    watchdog's own thread is the "Current thread"; the main thread is the other)."""
    mine = [x[len(f"[rank {rank}] "):] for x in err.splitlines() if x.startswith(f"[rank {rank}] ")]
    start = next((i for i, x in enumerate(mine) if x.startswith("Thread 0x")), None)
    return [] if start is None else [x.strip() for x in mine[start + 1:start + 4]]


def waiting_in(state: dict) -> dict:
    """The call a rank waits in: the one it blocks in, else its oldest started receive or
    collective not completed (a gradient bucket's all-reduce is waited on from outside)."""
    started = [e for e in state["entries"] if e["state"] == "started" and e["op"] != "send"]
    return next((e for e in started if e["id"] == state["waiting"]), started[0])


def calls_on(state: dict, group: str) -> int:
    return next((c["count"] for c in state["counts"]
                 if c["group"] == group and c["op"] == "collective"), 0)


def load(folder: str) -> dict[int, dict]:
    states = {}
    for r in (0, 1):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            states[r] = json.load(f)
    return states


root = tempfile.mkdtemp(prefix="refmp-tutorial-16-")
dp_dir, pp_dir = os.path.join(root, "dp"), os.path.join(root, "pp")
t0 = time.perf_counter()
jobs = {"dp": job(["--dp", "2"], "hang", dp_dir),  # both at once: they mostly wait
        "pp": job(["--pp", "2", "--microbatches", "2"], "recv", pp_dir)}

# --- 1. dp 2: rank 1 sleeps outside MPI ---------------------------------------------------------
print("Part 1. mpiexec -n 2 refmp train --dp 2, rank 1 asleep before step 3 (outside MPI)")
err = ended(jobs["dp"], t0, "dp 2")
print("  the watchdog's report (the leader's; every rank also prints its traceback):")
report = report_lines(err)
print("\n".join(f"    {x}" for x in report))
frames = main_thread(err, 1)
print("  rank 1's main thread, innermost first (faulthandler):")
print("\n".join(f"    {x}" for x in frames))
if not any("rank 1 has not entered allreduce@dp" in x for x in report):
    failures.append("the report does not say rank 1 has not entered the all-reduce")
if not frames or "inject_fault" not in frames[0]:
    failures.append(f"rank 1's traceback is not in inject_fault: {frames}")

# --- 2. the flight recorders by hand, then refmp trace ------------------------------------------
states = load(dp_dir)
waits = waiting_in(states[0])
group = waits["group"]
print(f"\nPart 2. {dp_dir}/rank0.json and rank1.json, by hand")
print(f"  rank 0 waits in {waits['op']} #{waits['seq']} on {group} ({waits['bytes']:,} B "
      f"{waits['dtype']}, step {waits['step']}, state {waits['state']}, issued at "
      f"{os.path.basename(waits['frame'][0])}:{waits['frame'][1]} {waits['frame'][2]})")
print("  rank 0's last calls:")
for e in states[0]["entries"][-4:]:
    print(f"    #{e['seq']:<3} {e['op']:<10} on {e['group']:<10} {e['bytes']:>7,} B  "
          f"step {e['step']}  {e['state']}")
counts = {r: calls_on(st, group) for r, st in states.items()}
behind = [r for r, c in counts.items() if c < waits["seq"]]
print(f"  calls made on {group}: " + ", ".join(f"rank {r} {c}" for r, c in counts.items())
      + f"; behind #{waits['seq']}: rank(s) {behind}")
if behind != [1]:
    failures.append(f"the counts name ranks {behind}, not rank 1")
out = subprocess.run([sys.executable, "-m", "refmp", "trace", dp_dir, "--last", "3"],
                     capture_output=True, text=True, timeout=60)
print(f"  refmp trace {dp_dir} --last 3:")
print("\n".join(f"    {x}" for x in out.stdout.splitlines()))
if out.returncode != 0 or "rank 1 has not entered allreduce@dp" not in out.stdout:
    failures.append(f"refmp trace does not name rank 1: {out.stderr[-500:]}")

# --- 3. pp 2: a receive that never gets its message ---------------------------------------------
print("\nPart 3. mpiexec -n 2 refmp train --pp 2, rank 1 receives what rank 0 never sends")
err = ended(jobs["pp"], t0, "pp 2")
report = report_lines(err)
print("\n".join(f"    {x}" for x in report))
states = load(pp_dir)
for r, st in states.items():
    e = waiting_in(st)
    peer = states[e["peer"]]
    sent = next((c["count"] for c in peer["counts"] if c["group"] == e["group"]
                 and c["op"] == "send" and c["peer"] == r and c["tag"] == e["tag"]), 0)
    print(f"  rank {r} waits for message #{e['seq']} from rank {e['peer']} with tag {e['tag']}, "
          f"issued at {os.path.basename(e['frame'][0])}:{e['frame'][1]} {e['frame'][2]}; "
          f"rank {e['peer']} has sent {sent} with that tag")
print("  each waits for the other; rank 0's wait is the pipeline's (executor.py), rank 1's is\n"
      "  not (the hook's, tag 32766, which no pipeline message has): rank 1 is the stuck one.")
if not any("rank 0 has not sent message #1 (tag 32766)" in x for x in report):
    failures.append("the report does not name the message rank 1 waits for")

import shutil  # noqa: E402

shutil.rmtree(root, ignore_errors=True)
for f in failures:
    print("MISMATCH:", f)
print("OK: the watchdog named the stuck rank" if not failures else "FAILED")
sys.exit(0 if not failures else 1)
