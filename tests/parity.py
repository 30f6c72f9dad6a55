"""Serial-vs-parallel parity of whole training steps, for any layout (used by many tests).

Rank 0 trains the serial model itself (on MPI.COMM_SELF, the whole batch); every rank trains
the layout under test (on COMM_WORLD). After each step the layout's whole gradient and whole
weights are gathered to rank 0 (Engine.full_grads / full_params: collective) and compared
element by element with the serial run's, as are the loss and the gradient norm. Rank 0's
mismatches are shared with every rank after each step (mpi_helpers.Mismatches.assert_none
over the world), so a failing run fails on all ranks together, at its first bad step.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi_helpers import Mismatches

from refmp.distributed.grid import ProcessGrid
from refmp.runtime import backend
from refmp.training.trainer import TrainConfig, Trainer

TOL = dict(rtol=1e-9, atol=1e-12)  # float64: rounding only (sums in other orders)
SERIAL_ONLY = ("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel", "microbatches",
               "schedule", "virtual_stages", "stage_layers", "cp_algo", "cp_balance",
               "bucket_mb", "dp_reduce", "hpz_size", "cp_ulysses", "dp_shard", "etp")


def serial_config(cfg: TrainConfig) -> TrainConfig:
    """The same run on one rank: every layout field at its default."""
    from dataclasses import fields, replace

    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in SERIAL_ONLY}
    return replace(cfg, **defaults)


def host(d: dict) -> dict:
    return {k: np.asarray(backend.to_host(v)) for k, v in d.items()}


def gathered(par: Trainer) -> tuple:
    """The layout's whole gradient and weights (collective), left out of its ledger, so
    that tests can hold the ledger of the training steps alone against the formulas."""
    led = par.grid.ledger
    saved = {k: list(v) for k, v in led.entries.items()}
    out = par.runner.full_grads(), par.runner.full_params()
    led.entries.clear()
    led.entries.update(saved)
    return out


def compare_step(bad: Mismatches, a: dict, b: dict, serial: Trainer, grads: dict, params: dict,
                 tol: dict, s: int) -> None:
    """Rank 0: step ``s`` of the layout (record ``b``, whole ``grads`` and ``params``) against
    the serial run's (record ``a``, its trainer ``serial``), every mismatch into ``bad``."""
    close = np.testing.assert_allclose
    sg, sp = host(serial.runner.full_grads()), host(serial.runner.full_params())
    bad.check(close, b["loss"], a["loss"], **tol, err_msg=f"loss at step {s}")
    bad.check(close, b["grad_norm"], a["grad_norm"], **tol, err_msg=f"norm at step {s}")
    if "moe" in a:
        bad.check(close, b["moe"]["aux_loss"], a["moe"]["aux_loss"], **tol,
                  err_msg=f"aux loss at step {s}")
        bad.check(close, b["moe"]["tokens_per_expert"], a["moe"]["tokens_per_expert"],
                  err_msg=f"tokens per expert at step {s}")
    grads, params = host(grads), host(params)
    for k in sp:
        bad.check(close, grads[k], sg[k], **tol, err_msg=f"gradient {k} at step {s}")
        bad.check(close, params[k], sp[k], **tol, err_msg=f"weight {k} after step {s}")


def assert_same_run(cfg: TrainConfig, ds=None, grid: ProcessGrid | None = None,
                    tol: dict | None = None, check=None) -> Trainer:
    """Train ``cfg`` on the world and serially; assert every step matches. Returns the
    parallel Trainer (its ledger and memory for further checks). ``check(par, step)``, if
    given, runs after each step on every rank (collectives allowed; an AssertionError it
    raises after its last collective is agreed on like a mismatch).

    Collective over the world: after each step every rank learns the verdict (an allgather
    of the mismatches rank 0 found, and of what ``check`` raised), and if anything is wrong
    every rank raises the same AssertionError at once, naming the first mismatches. Rank 0
    must not raise alone: the other ranks would wait in their next collective until the
    test's timeout."""
    tol = tol or TOL
    world = MPI.COMM_WORLD
    serial = None
    if world.rank == 0:
        serial = Trainer(serial_config(cfg), grid=ProcessGrid(MPI.COMM_SELF), dataset=ds)
    par = Trainer(cfg, grid=grid, dataset=ds)
    bad = Mismatches()
    for s in range(cfg.steps):
        a = None
        if serial is not None:
            try:
                a = serial.step()
            except Exception as e:  # noqa: BLE001  (agreed on below, on every rank)
                bad.errors.append(f"the serial run's step {s}: {type(e).__name__}: {e}")
        b = par.step()
        grads, params = gathered(par)
        if check is not None:
            bad.check(check, par, s)
        if a is not None:
            try:
                compare_step(bad, a, b, serial, grads, params, tol, s)
            except Exception as e:  # noqa: BLE001  (a missing key, a shape: agreed on below)
                bad.errors.append(f"comparing step {s}: {type(e).__name__}: {e}")
        bad.assert_none(world)
    return par
