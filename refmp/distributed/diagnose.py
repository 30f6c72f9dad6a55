"""Who is stuck, from every rank's flight recorder: the analysis the watchdog prints and
``refmp trace`` prints again from the files.

A state is what one rank wrote when the watchdog fired (refmp.distributed.watchdog): its
recorder (refmp.distributed.recorder.Recorder.dump: entries, per-group counts, the entry
a blocking call waits in), the wall time it wrote it, and its main thread's Python stack.
Pure: no MPI, no files.

The rules, one per kind of wait (the recorder's docstring says why sequence numbers match):

* a collective #k on group G that a rank waits in (or has started and not seen complete):
  each member of G whose count on G is below k **has not entered** it; a member whose k-th
  call on G is another operation, or the same on another size or dtype, made a
  **mismatched call**; when every other member has **completed** it, the rank waits for
  data they never send (their counts disagree with its own, as in an all-to-all-v);
* a receive #k from rank p with tag t: p **has not sent** it when p's count of sends to
  this rank with tag t is below k (a blocking send the same way, with receives);
* a rank that waits in nothing is **not in MPI** (computing, or blocked outside MPI): its
  innermost frame says where; a rank that wrote no state did not answer at all.
"""

from __future__ import annotations

import os

COLLECTIVE = "collective"


def _label(group: str) -> str:
    """"dp" of "dp[0,1]" and of "dp~2[0,1]" (another communicator of those ranks)."""
    return group.split("[")[0].split("~")[0]


def _members(group: str) -> list[int]:
    return [int(r) for r in group[group.index("[") + 1:-1].split(",")]


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _count(state: dict, group: str, op: str = COLLECTIVE, peer: int = -1, tag: int = -1) -> int:
    for c in state["counts"]:
        if c["group"] == group and c["op"] == op and c.get("peer", -1) == peer \
                and c.get("tag", -1) == tag:
            return c["count"]
    return 0


def _where(frame) -> str:
    return f"{os.path.basename(frame[0])}:{frame[1]} {frame[2]}"


def _call(e: dict) -> str:
    """"allreduce@dp #5" (and the peer and tag of a message)."""
    text = f"{e['op']}@{_label(e['group'])} #{e['seq']}"
    if e["peer"] >= 0:
        text += f" {'to' if e['op'] == 'send' else 'from'} rank {e['peer']} tag {e['tag']}"
    return text


def _detail(e: dict) -> str:
    return f"{e['op']} {e['bytes']} B {e['dtype']} at {_where(e['frame'])}"


def waits(state: dict) -> list[dict]:
    """The calls a rank waits for: the one it blocks in, the oldest unfinished collective of
    each group, and its unfinished receives (a started send is left to its receiver)."""
    out, seen = [], set()
    for e in state["entries"]:
        if e["state"] != "started":
            continue
        blocking = e["id"] == state.get("waiting")
        first_on_group = e["peer"] < 0 and e["group"] not in seen
        if blocking or first_on_group or e["op"] == "recv":
            out.append(e)
        if e["peer"] < 0:
            seen.add(e["group"])
    return out


def _doing(state: dict | None) -> str:
    """What a rank is doing, in a few words."""
    if state is None:
        return "did not answer (no state: stuck holding the interpreter, or gone)"
    blocking = [e for e in state["entries"] if e["id"] == state.get("waiting")]
    step = ("outside training" if state["step"] < 0 else f"at step {state['step']}"
            + (f", micro-batch {state['microbatch']}" if state["microbatch"] >= 0 else ""))
    if blocking:
        e = blocking[0]
        return f"waits in {_call(e)} for {state['time'] - e['t_start']:.1f} s, {step}"
    inner = state["stack"][-1] if state.get("stack") else None
    where = f", in {_where(inner)}" if inner else ""
    return (f"is not in MPI (computing, or blocked outside MPI) for "
            f"{state['time'] - state['progress']:.1f} s since its last call, {step}{where}")


def findings(states: dict[int, dict], world_size: int) -> list[str]:
    """The sentences naming the stuck ranks and the mismatched calls."""
    missing: dict[tuple, set[int]] = {}  # (call text) -> ranks that have not entered it
    waiting: dict[tuple, set[int]] = {}  # (call text) -> ranks waiting in it
    out: list[str] = []
    named: set[int] = set()
    mismatched: set[tuple] = set()  # (group, seq, rank, rank) said once
    completed: dict[tuple, set[int]] = {}  # (call text, waiting rank) -> members done with it
    for r, st in sorted(states.items()):
        for e in waits(st):
            if e["peer"] >= 0:  # a message: does its peer's count reach it?
                peer = states.get(e["peer"])
                other = "send" if e["op"] == "recv" else "recv"
                if peer is not None and _count(peer, e["group"], other, r, e["tag"]) < e["seq"]:
                    verb = "sent" if other == "send" else "posted the receive of"
                    out.append(f"rank {e['peer']} has not {verb} message #{e['seq']} (tag "
                               f"{e['tag']}) on {_label(e['group'])} that rank {r} waits for "
                               f"in {e['op']}")
                    named.add(e["peer"])
                continue
            for m in _members(e["group"]):
                st_m = states.get(m)
                if m == r or st_m is None:
                    continue
                if _count(st_m, e["group"]) < e["seq"]:
                    key = (e["op"], e["group"], e["seq"])
                    missing.setdefault(key, set()).add(m)
                    waiting.setdefault(key, set()).add(r)
                    continue
                theirs = [x for x in st_m["entries"]
                          if x["group"] == e["group"] and x["peer"] < 0 and x["seq"] == e["seq"]]
                pair = (e["group"], e["seq"], min(r, m), max(r, m))
                if theirs and any(theirs[0][k] != e[k] for k in ("op", "bytes", "dtype")):
                    if pair not in mismatched:
                        mismatched.add(pair)
                        out.append(f"mismatched calls on {e['group']} #{e['seq']}: rank {r} "
                                   f"{_detail(e)}; rank {m} {_detail(theirs[0])}")
                        named.update((r, m))
                elif theirs and theirs[0]["state"] == "completed":
                    completed.setdefault((e["op"], e["group"], e["seq"], r), set()).add(m)
    for (op, group, seq), ranks in sorted(missing.items(), key=lambda kv: kv[0][2]):
        ranks -= waiting[(op, group, seq)]  # a waiter is not missing from its own call
        if ranks:
            out.insert(0, f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} not entered "
                          f"{op}@{_label(group)} #{seq} that {_ranks(waiting[(op, group, seq)])} "
                          f"wait{'s' if len(waiting[(op, group, seq)]) == 1 else ''} in")
            named |= ranks
    for (op, group, seq, r), ranks in sorted(completed.items(), key=lambda kv: kv[0][2:]):
        if ranks == set(_members(group)) - {r}:
            out.append(f"rank {r} waits in {op}@{_label(group)} #{seq}, which "
                       f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} completed: "
                       f"their counts or sizes disagree with rank {r}'s")
            named |= ranks | {r}
    silent = sorted(set(range(world_size)) - set(states))
    for r in silent:
        out.append(f"rank {r} {_doing(None)}")
    hosts = {st.get("host") for st in states.values()}  # on several nodes: say which
    for r in sorted(named - set(silent)):
        on = f" on {states[r].get('host')}" if len(hosts) > 1 else ""
        out.append(f"rank {r}{on} {_doing(states[r])}")
    if not out:
        idle = [r for r, st in states.items() if not waits(st)]
        out.append(f"no rank waits for another; {_ranks(idle)} made no progress" if idle
                   else "every rank waits, and no rank is behind: see the table")
    return out


def table(states: dict[int, dict]) -> list[str]:
    """One line per rank: group, op, sequence number, seconds waiting, step, where."""
    rows = [f"{'rank':>4}  {'group':<14} {'op':<14} {'seq':>6} {'waiting s':>9} {'step':>5} "
            f"{'mb':>3}  where"]
    for r, st in sorted(states.items()):
        w = waits(st)
        mb = st["microbatch"] if st["microbatch"] >= 0 else "-"
        if w:
            e = next((x for x in w if x["id"] == st.get("waiting")), w[0])
            rows.append(f"{r:>4}  {e['group']:<14} {e['op']:<14} {e['seq']:>6} "
                        f"{st['time'] - e['t_start']:>9.1f} {st['step']:>5} {mb:>3}  "
                        f"{_where(e['frame'])}")
        else:
            inner = st["stack"][-1] if st.get("stack") else ("?", 0, "?")
            rows.append(f"{r:>4}  {'(not in MPI)':<14} {'':<14} {'':>6} "
                        f"{st['time'] - st['progress']:>9.1f} {st['step']:>5} {mb:>3}  "
                        f"{_where(inner)}")
    return rows


def last_calls(state: dict, n: int) -> list[str]:
    """A rank's last ``n`` calls, a line each, oldest first (``refmp trace --last``)."""
    rows = [f"rank {state['rank']}: last {min(n, len(state['entries']))} of {state['calls']} calls"]
    for e in state["entries"][-n:]:
        peer = f" peer {e['peer']} tag {e['tag']}" if e["peer"] >= 0 else ""
        rows.append(f"  {e['group']:<14} {e['op']:<14} #{e['seq']:<6} {e['bytes']:>10} B "
                    f"{e['dtype'] or '':<8} {e['state']:<9} step {e['step']}{peer}  "
                    f"{_where(e['frame'])}")
    return rows


def report(states: dict[int, dict], world_size: int) -> str:
    """The table, then the findings: what the watchdog and ``refmp trace`` print."""
    return "\n".join([*table(states), *findings(states, world_size)])
