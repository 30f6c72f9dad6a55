"""Pipelines without a flush: PipeDream-2BW and PipeDream's weight stashing, on the executor.

Shapes: m micro-batches of a step, b_i rows of micro-batch i, T time, C channels; pp ranks.

A flush schedule (executor.py) ends each step with every gradient of its batch summed, so
every forward and backward of batch t runs on the weights W(t) of that step. These do not
flush: a step's action list also holds forwards (and 2BW's backwards) of later batches,
and the weights change under them. What that takes is held here, not in the executor:

* the caches, gradients and sends of the later batches' actions, carried into the next step
  (``carry``, ``stash``, ``pending``), and their loss and MoE figures;
* weight versions: 2BW's W(t-1) (``previous``; Narayanan et al. ICML 2021), PipeDream's
  stashed W(k) (``versions``; Narayanan et al. SOSP 2019), copies of the Sharder's buffers
  that the Sharder computes on when asked (``Sharder.weights(version=)``).
The tags need nothing more: each chunk's forwards, and its backwards, run in batch and
micro-batch order across the steps too, so the executor's tags (receiving chunk and
direction) hold across the step boundary.

Micro-batch i of a step's lists is batch t + i // m's micro-batch i % m (pipedream.two_bw,
pipedream.pipedream). Each cache remembers the weight version it was made on, and its
backward asserts it runs on the same.
"""

from __future__ import annotations

import time
from functools import partial

from refmp.distributed.waiting import wait_all
from refmp.nn.routing import MoEFigures
from refmp.parallel.pipeline.executor import Executor
from refmp.parallel.pipeline.pipedream import pipedream_version
from refmp.parallel.pipeline.schedules import Action
from refmp.parallel.pipeline.stage import Route


class GradStash:
    """2BW: takes the gradients of a backward of the next batch run before this step's
    update (pipedream.two_bw; the ``sink`` of Stage.backward's Route). They are summed here, in the order
    they come, and added to the Sharder's after the next step's zero_grad (``replay``): the
    same sums in the same order as the serial run's, so the step's gradient is batch t's
    alone."""

    def __init__(self, sharder):
        self.sharder = sharder
        self.sums: dict = {}  # unit -> {name: summed gradient}
        self.final: set[str] = set()  # units completed by the batch's last micro-batch

    def accumulate(self, u: str, g: dict) -> None:
        sums = self.sums.setdefault(u, {})
        for k, v in g.items():  # in the gradients' dtype, as the Sharder's buffers add them
            if k in sums:
                sums[k] += v
            else:
                sums[k] = v.astype(self.sharder.gdtype)

    def grad_ready(self, u: str, final: bool) -> None:
        if final:  # the Sharder hears of it in replay
            self.final.add(u)

    def nbytes(self) -> int:
        return sum(int(v.nbytes) for g in self.sums.values() for v in g.values())

    def replay(self) -> None:
        for u, g in self.sums.items():
            self.sharder.accumulate(u, g)
            self.sharder.grad_ready(u, u in self.final)
        self.sums = {}
        self.final = set()


class AsyncExecutor(Executor):
    """The step loop of a schedule without a flush; :class:`TwoBW` and :class:`PipeDream`
    say which weights each action runs on and what is kept after the update."""

    def __init__(self, stage, comm, dtype, on_forward=None, placed=None):
        super().__init__(stage, comm, dtype, on_forward, placed)
        self.sharder = stage.sharder
        self.updates = 0  # the steps run: the current weights are W(updates)
        self.carry: dict = {}  # (micro-batch, chunk) -> (version, released, cache)
        self.pending: list = []  # the later batches' sends, finished at the next step's end
        self.stash = GradStash(self.sharder)  # the later batch's gradients (2BW)
        self.stash_bytes = 0  # its peak
        self.ahead_loss = 0.0  # the later batch's loss shares, the next step's
        self.ahead_figures = MoEFigures()  # and its MoE figures
        self.carry_on = False  # the last step ran the next batch's first actions

    @property
    def fills(self) -> bool:
        """Whether the next step fills the pipeline (starts from an empty one)."""
        raise NotImplementedError

    def forward_version(self, ahead: bool) -> int:
        """The weight version a forward runs on (``ahead``: of a later batch)."""
        raise NotImplementedError

    def weights_of(self, version: int):
        """Sharder.weights for weight version ``version`` (None: the current buffers)."""
        raise NotImplementedError

    def route(self, version: int, release: bool, ahead: bool) -> Route:
        """Where a pass takes its weights (version ``version``; ``release``: the forward's
        cache names them, which the backward attaches again) and where a later batch's
        (``ahead``) MoE figures and gradients go: aside, until its own step."""
        return Route(self.weights_of(version) or self.sharder.weights,
                     self.stash if ahead else self.sharder,
                     self.ahead_figures if ahead else self.stage.figures,
                     release or self.sharder.releases_weights)

    def after_backwards(self) -> None:
        """At the end of a step, before its update: keep what later steps compute on."""
        raise NotImplementedError

    def begin(self) -> None:
        """A step begins: what the last one ran of this batch joins this step's sums."""
        self.stash.replay()  # the gradients of this batch's backwards run last step
        self.stage.figures.merge(self.ahead_figures)  # its forwards' MoE figures
        self.ahead_figures = MoEFigures()

    def step(self, actions: list[Action], xs: list, ys: list, denom: int, m: int) -> float:
        """Run one step's actions; xs[i], ys[i] are micro-batch i's (b_i, T) ids and targets,
        ``m`` the step's micro-batches (xs also holds the later batches'). Returns this
        rank's loss share of this step's batch."""
        stage = self.stage
        last = stage.n_chunks - 1  # the chunk with the head and the loss
        assert all(a.kind != "W" for a in actions), "no zero-bubble split without a flush"
        self.begin()
        caches = dict(self.carry)  # the later batch's forwards of the last step
        pending = self.pending  # their sends: finished at this step's end
        self.pending = []  # the sends of this step's later-batch actions
        loss = self.ahead_loss
        self.ahead_loss = 0.0
        self.events = []
        self.peak_held = len(caches)
        for a in actions:
            i, c = a.mb, a.chunk
            ahead = i >= m  # a later batch's micro-batch
            sends = self.pending if ahead else pending
            self.comm.recorder.microbatch = i  # the flight recorder's label of each call
            shape = stage.act_shape(*xs[i].shape)  # (b_i, T, C); T/tp with SP
            if a.kind == "F":
                inp = xs[i] if c == 0 else self.recv_forward(shape, i, c)
                t0 = time.perf_counter()
                version = self.forward_version(ahead)
                # ahead: the update overwrites its weights before its backward, so release them
                out, cache = stage.forward(c, inp, ys[i], denom, self.route(version, ahead, ahead))
                caches[i, c] = (version, ahead, cache)
                self.peak_held = max(self.peak_held, len(caches))
                self._event("F", i, c, t0)
                self._measure(caches, tuple(sorted(
                    (ch, v - self.updates, run_ahead, xs[mb].shape)
                    for (mb, ch), (v, run_ahead, _) in caches.items())))
                if c == last and ahead:  # the next step's loss
                    self.ahead_loss += float(out)
                elif c == last:
                    loss += float(out)
                else:
                    self.send_forward(out, shape, i, c, sends)
            else:  # B
                dout = None if c == last else self.recv_backward(shape, i, c)
                t0 = time.perf_counter()
                made_on, released, cache = caches.pop((i, c))
                self.check_version(i, made_on, ahead)
                dx, _ = stage.backward(c, dout, cache, False, final=i % m == m - 1,
                                       route=self.route(made_on, released, ahead))
                self.stash_bytes = max(self.stash_bytes, self.stash.nbytes())
                self._event("B", i, c, t0)
                if dx is not None:
                    self.send_backward(dx, shape, i, c, sends)
        self.carry_on = len(xs) > m
        self.comm.recorder.microbatch = -1
        t0 = time.perf_counter()
        # the later batch's sends are finished at the end of the next step, which runs the
        # rest of that batch on every rank, so their receivers have taken them by then
        wait_all([req for req, _ in pending])
        self._event("send", -1, -1, t0)
        self.carry = {(i - m, c): v for (i, c), v in caches.items() if i >= m}
        assert len(self.carry) == len(caches), "a micro-batch's cache was left over"
        self.after_backwards()
        self.updates += 1
        return loss

    def check_version(self, i: int, made_on: int, ahead: bool) -> None:
        """A backward runs on the weight version its forward ran on."""
        want = self.backward_version(ahead)
        if made_on != want:
            raise AssertionError(f"rank {self.comm.rank}: micro-batch {i}'s backward on "
                                 f"W({want}), its forward on W({made_on})")

    def backward_version(self, ahead: bool) -> int:
        """The weight version a backward runs on, stated apart from the forward's."""
        return self.forward_version(ahead)


class TwoBW(AsyncExecutor):
    """PipeDream-2BW (pipedream.two_bw): batch t runs on W(t-1), its predecessor's weights
    (W(-1) = W(0)); batch t+1's first actions, in step t, on W(t). Two versions per stage:
    the Sharder's current buffers and ``previous``."""

    def __init__(self, stage, comm, dtype, on_forward=None, placed=None):
        super().__init__(stage, comm, dtype, on_forward, placed)
        self.previous: dict = {}  # unit -> W(t-1)

    @property
    def fills(self) -> bool:
        return not self.carry_on  # the first step, or after a drain

    def begin(self) -> None:
        if not self.previous:
            self.previous = self.sharder.snapshot()  # W(-1) = W(0)
        super().begin()

    def forward_version(self, ahead: bool) -> int:
        return self.updates - 1 + ahead  # W(t-1), or W(t) for batch t+1

    def weights_of(self, version: int):
        if version == self.updates:
            return None  # the current buffers
        return partial(self.sharder.weights, version=self.previous)

    def after_backwards(self) -> None:
        self.previous = self.sharder.snapshot(into=self.previous)  # the update makes W(t+1)

    def memory(self) -> dict[str, int]:
        return {"versions": sum(int(b.nbytes) for b in self.previous.values()),
                "grad_stash": self.stash_bytes}

    def resident(self) -> list:
        return list(self.previous.values())


class PipeDream(AsyncExecutor):
    """PipeDream with weight stashing (pipedream.pipedream): every forward runs on the
    current weights W(t); one whose backward comes after this step's update names its
    weights, and at the end of the step W(t) is copied aside for it (``versions``). A
    backward attaches the version its forward ran on, which must be
    pipedream.pipedream_version's."""

    def __init__(self, stage, comm, dtype, on_forward=None, placed=None):
        super().__init__(stage, comm, dtype, on_forward, placed)
        self.versions: dict[int, dict] = {}  # k -> {unit: W(k)}, the current one not among them
        self.version_bytes = 0  # their peak

    @property
    def fills(self) -> bool:
        return self.updates == 0

    def forward_version(self, ahead: bool) -> int:
        return self.updates

    def backward_version(self, ahead: bool) -> int:
        return pipedream_version(self.comm.size, self.comm.rank, self.updates)

    def weights_of(self, version: int):
        if version == self.updates:
            return None
        return partial(self.sharder.weights, version=self.stashed(version))

    def stashed(self, version: int) -> dict | None:
        """The buffers of weight version ``version`` (None: the current one)."""
        return None if version == self.updates else self.versions[version]

    def after_backwards(self) -> None:
        """Keep W(t) for the carried caches; drop what no cache names."""
        made = {v for v, _, _ in self.carry.values()}
        self.versions = {k: b for k, b in self.versions.items() if k in made}
        if self.updates in made:
            self.versions[self.updates] = self.sharder.snapshot()
        self.version_bytes = max(self.version_bytes, sum(
            int(b.nbytes) for bufs in self.versions.values() for b in bufs.values()))

    def memory(self) -> dict[str, int]:
        return {"versions": self.version_bytes}


ASYNC_EXECUTORS = {"2bw": TwoBW, "pipedream": PipeDream}
