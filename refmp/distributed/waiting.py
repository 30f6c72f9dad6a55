"""Waiting on MPI requests without burning the core a working rank needs.

MPICH busy-polls inside blocking calls, so a rank that waits there would take the core a
working rank needs when ranks outnumber cores. refmp therefore starts every operation
nonblocking and waits with Test-and-sleep (:func:`wait`). MPI moves a nonblocking operation
on only inside a call such as Test, and a collective takes many such steps (a sleep after
each would multiply its time), so when the ranks fit the cores a wait first tests without
pause for 1 ms (``REFMP_SPIN_US``), then sleeps between tests, backing off from 10 us to a
cap: 100 us, because a message that arrives while its receiver sleeps waits for the wake-up
(in a pipeline, on every hop). When this node's ranks outnumber its cores there is no
spinning (a spinning rank would hold the core a working one needs), and the cap is the same
100 us: a waiting rank's wake-ups then cost about a tenth of a core, less than the waits a
longer sleep adds (tp 4 on 4 ranks of 2 cores took 1.6-1.8x as long with a 1 ms cap;
docs/speed.md). ``REFMP_POLL_US`` sets the cap. A request a Comm returns is finished here
(:func:`wait`), and :func:`progress` lets it move on meanwhile.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

from refmp.runtime import cpu


class StagedRequest(MPI.Request):
    """A request with work left for when it completes: a result to copy from a host staging
    buffer to the device, the flight recorder's entry to mark completed (Transport._tracked).

    :func:`wait` calls ``finish`` once the request completes; ``keep`` holds the host buffer
    alive until then (MPI reads or writes it asynchronously).
    """

    def __new__(cls, req: MPI.Request, finish=None, keep=None):
        self = super().__new__(cls, req)
        self.finish = finish
        self.keep = keep
        return self


def _env_us(name: str) -> float | None:
    """The environment's ``name`` in microseconds, as seconds (None if unset; refused if bad)."""
    given = os.environ.get(name)
    if given is None:
        return None
    if not given.isdigit():
        from refmp.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(f"{name} must be a whole number of microseconds, got {given!r}")
    return int(given) * 1e-6


def poll_cap() -> float:
    """The longest sleep between tests, in seconds (see the module docstring)."""
    given = _env_us("REFMP_POLL_US")
    if given is not None:
        return given
    return 1e-4


def spin_time() -> float:
    """How long a wait keeps testing before its first sleep, in seconds (module docstring)."""
    given = _env_us("REFMP_SPIN_US")
    if given is not None:
        return given
    return 0.0 if cpu.local_ranks() > cpu.cores() else 1e-3


_poll_cap: float | None = None  # poll_cap(), read at the first wait
_spin: float | None = None  # spin_time(), likewise


def sleep_until(done) -> None:
    """Call ``done()`` until it is true: without pause for spin_time(), then sleeping between
    calls (10 us, doubling to poll_cap())."""
    global _poll_cap, _spin
    if _poll_cap is None:
        _poll_cap, _spin = poll_cap(), spin_time()
    end, delay = time.perf_counter() + _spin, 1e-5
    while not done():
        if time.perf_counter() < end:
            continue  # still spinning
        time.sleep(delay)
        delay = min(delay * 2, _poll_cap)


def wait(req: MPI.Request | None) -> None:
    """Wait for a request: Test without pause for spin_time(), then Test and sleep, backing
    off to poll_cap() (see the module docstring).

    ``None`` (what a size-1 communicator returns for a skipped operation) is already done.
    """
    if req is None:
        return
    sleep_until(req.Test)  # Test also drives MPI's progress engine
    if isinstance(req, StagedRequest) and req.finish is not None:
        req.finish()
        req.finish = None
        req.keep = None


def wait_all(reqs: list[MPI.Request | None]) -> None:
    for r in reqs:
        wait(r)


def progress(req: MPI.Request | None) -> None:
    """Let MPI move ``req`` on without waiting for it: one Test (MPICH has no progress thread,
    so an operation started nonblocking advances only inside such calls). Finish it with
    :func:`wait`, which also completes a staged result."""
    if req is not None:
        req.Test()
