"""Interpret a rank's action list over MPI: one training step of a pipeline schedule.

Shapes: b_i rows of micro-batch i, T time, C channels; pp ranks, S chunks (chunk c on rank
placement.chunk_rank(c): c % pp, or in a V). T is the tokens of a sequence this rank holds
(T/cp with context parallelism); with sequence parallelism a boundary carries (b_i, T/tp, C)
(Korthikanti et al. 2022, sec. 4.2: the block's output is already sharded along T), so SP
divides these bytes by tp.

Communication (on grid.comm["pp"]), implied by the chunk graph (schedules.py):
  after F(i, c), c < S-1: send the output (b_i, T, C) to chunk c+1's rank   (an activation)
  before F(i, c), c > 0:  receive chunk c's input from chunk c-1's rank
  after B(i, c), c > 0:   send the input gradient (b_i, T, C) to chunk c-1's rank
  before B(i, c), c < S-1: receive the output gradient from chunk c+1's rank
(in a V the turn, chunk pp-1 to pp, is a message a rank sends itself).
Sends are nonblocking (finished at the end of the step), so a rank blocks only in a receive,
and only on the message its next action needs: the simulator proved such lists complete.
Receives sleep between tests (Comm.recv). Each receive makes a new array that belongs to one
micro-batch's cache; no buffer is reused, so no cache can alias another micro-batch's data.
The tag names the micro-batch, the chunk and the direction, and the receiver states the shape
and dtype it expects (Comm.recv refuses a message of another size).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait_all
from refmp.parallel.pipeline.schedules import Action, pipedream_version
from refmp.parallel.pipeline.stage import Stage
from refmp.parallel.pipeline.timeline import Event
from refmp.parallel.placement import chunk_rank


def tag(mb: int, chunk: int, n_chunks: int, grad: bool) -> int:
    """A tag per (micro-batch, receiving chunk, direction): messages cannot be confused."""
    return 2 * (mb * n_chunks + chunk) + int(grad)


class GradStash:
    """2BW: takes the gradients of a backward of the next batch run before this step's
    update (schedules.two_bw; Stage.backward's ``sink``). They are summed here, in the order
    they come, and added to the Sharder's after the next step's zero_grad (``replay``): the
    same sums in the same order as the serial run's, so the step's gradient is batch t's
    alone."""

    def __init__(self, sharder):
        self.sharder, self.sums = sharder, {}  # unit -> {name: summed gradient}
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
        self.sums, self.final = {}, set()


class Executor:
    """Runs action lists for one Stage over the pp communicator, timing every action.

    ``dtype``: the activations' (what crosses a stage boundary); ``on_forward``, if given, is
    called with the live caches after a forward (the engine measures their bytes) whenever
    they are a new set: one not seen before as each cache's chunk, weight version (relative
    to the step's), whether it runs ahead and its micro-batch's shape, which fix the bytes
    (walking the caches costs 0.1 ms, on the pipeline's critical path, every forward);
    ``v_shape``: the chunks are placed in a V (ZB-V, DualPipeV)."""

    def __init__(self, stage: Stage, comm: Comm, dtype,
                 on_forward: Callable[[dict], None] | None = None, v_shape: bool = False):
        self.stage, self.comm, self.dtype, self.on_forward = stage, comm, dtype, on_forward
        self.v_shape, self.sharder = v_shape, stage.sharder
        self.events: list[Event] = []  # the last step's timeline on this rank
        self.peak_held = 0  # most micro-batch caches held at once in the last step
        self.measured: set[tuple] = set()  # the sets of caches on_forward has seen
        # 2BW: what a step leaves open for the next: the caches (micro-batch, chunk) ->
        # (weight version, released, cache) of the next batch's forwards, the gradients of
        # its backwards (stash; stash_bytes its peak), the step's sends, its loss and MoE figures
        # (aux, moe_raw); whether it ran the next batch's first actions (carry_on); the
        # updates seen (the versions)
        self.carry: dict = {}
        self.stash = GradStash(self.sharder)
        self.pending: list = []
        self.ahead_stats: tuple = (0.0, {})
        self.updates, self.carry_on, self.stash_bytes, self.ahead_loss = 0, False, 0, 0.0
        # pipedream: copies of the weight versions W(k) that carried caches were made on,
        # k -> {unit: buffer} (the current version is the Sharder's), and their peak bytes
        self.versions: dict[int, dict] = {}
        self.version_bytes = 0

    def fills(self, stashing: bool) -> bool:
        """Whether the next step fills the pipeline: pipedream's first, 2bw's after a drain."""
        return self.updates == 0 if stashing else not self.carry_on

    def stashed(self, version: int) -> dict | None:
        """pipedream: the buffers of weight version ``version`` (None: the current one)."""
        return None if version == self.updates else self.versions[version]

    def weights(self, version: dict | None):
        """The Sharder's weights of ``version`` (2bw's W(t-1), a stashed copy); None: current."""
        return None if version is None else partial(self.sharder.weights, version=version)

    def _send(self, x, shape, mb: int, chunk: int, grad: bool, pending: list) -> None:
        t0 = time.perf_counter()
        dest = chunk_rank(chunk, self.comm.size, self.v_shape)
        if x.shape != shape or x.dtype != self.dtype:  # the receiver expects exactly this
            raise ValueError(f"rank {self.comm.rank}: micro-batch {mb} for chunk {chunk} is "
                             f"{x.shape} {x.dtype}, expected {shape} {self.dtype}")
        pending.append((self.comm.send(x, dest, tag(mb, chunk, self.stage.n_chunks, grad)), x))
        self._event("send", mb, chunk, t0)

    def _recv(self, shape, mb: int, chunk: int, grad: bool):
        t0 = time.perf_counter()
        src = chunk_rank(chunk + (1 if grad else -1), self.comm.size, self.v_shape)
        x = self.comm.recv(shape, self.dtype, src, tag(mb, chunk, self.stage.n_chunks, grad))
        self._event("recv", mb, chunk, t0)
        return x  # a fresh array, owned by micro-batch mb alone

    def _event(self, kind: str, mb: int, chunk: int, t0: float) -> None:
        self.events.append(Event(self.comm.rank, kind, mb, chunk, t0, time.perf_counter()))

    def step(self, actions: list[Action], xs: list, ys: list, denom: int,
             dloss: float = 1.0, delayed: bool = False, m: int | None = None,
             stashing: bool = False) -> float:
        """Run one step's actions; xs[i], ys[i] are micro-batch i's (b_i, T) ids and targets;
        ``m`` the step's micro-batches (default: all of xs); ``dloss`` the gradient of each
        loss share (the loss scale with fp16, else 1).

        ``delayed`` (2BW, schedules.two_bw): micro-batches 0..m-1 are this step's batch t,
        computed on the Sharder's previous weight version W(t-1) (W(-1) = W(0)); the lists'
        micro-batches m..2m-1 (xs holds 2m then) are batch t+1's first ones, on W(t), the
        current version. Their caches (which name their weights: the update overwrites the
        buffer), gradients and sends stay open into the next step, whose list starts where
        this one ends. Each cache remembers the version it was made on, and its backward
        asserts it runs on the same. After the last action W(t) becomes the previous version
        (the update then makes W(t+1) of W(t)).

        ``stashing`` (pipedream, schedules.pipedream): micro-batches j m..j m + m - 1 are
        batch t + j's. Every forward runs on the current weights W(t); one whose backward
        comes after this step's update (j > 0) names its weights, and at the end of the step
        W(t) is copied aside for it. A backward (of batch t) attaches the version its
        forward ran on and asserts that it is schedules.pipedream_version's.

        Returns this rank's loss share (non-zero on the rank holding the last chunk).
        """
        stage, sharder, n_chunks, m = self.stage, self.sharder, self.stage.n_chunks, m or len(xs)
        P, rank = self.comm.size, self.comm.rank
        if delayed and not sharder.previous:
            sharder.keep_previous()  # W(-1) = W(0)
        split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}  # B's whose W is listed
        caches, todos, pending, self.pending = dict(self.carry), {}, self.pending, []
        self.stash.replay()  # the gradients of this batch's backwards run last step
        stage.aux += self.ahead_stats[0]  # and its forwards' MoE figures
        stage.moe_raw.update(self.ahead_stats[1])
        self.ahead_stats = (0.0, {})
        loss, caches_held, self.ahead_loss = self.ahead_loss, len(caches), 0.0
        self.events, self.peak_held = [], caches_held
        for a in actions:
            i, c = a.mb, a.chunk
            j = i // m  # batch t + j's micro-batch i % m
            ahead = j > 0  # 2BW: batch t+1's micro-batch i - m; pipedream: after the update
            version = self.updates + (ahead - 1 if delayed else 0)  # what the action runs on
            on = sharder.previous if delayed and not ahead else None  # 2bw's W(t-1)
            self.comm.recorder.microbatch = i  # the flight recorder's label of each call
            final = i % m == m - 1  # its batch's last micro-batch
            # by batch parity (2bw), by batch mod pp (pipedream)
            mb_tag = ((self.updates * m + i) % (2 * m) if delayed else
                      ((self.updates + j) % P) * m + i % m if stashing else i)
            shape = stage.act_shape(*xs[i].shape)  # (b_i, T, C); T/tp with SP
            if a.kind == "F":
                inp = xs[i] if c == 0 else self._recv(shape, mb_tag, c, grad=False)
                t0 = time.perf_counter()
                if ahead:  # its MoE figures belong to the next step's
                    (stage.aux, stage.moe_raw), mine = self.ahead_stats, (stage.aux, stage.moe_raw)
                out, cache = stage.forward(c, inp, ys[i], denom, weights=self.weights(on),
                                           release=ahead)
                if ahead:
                    self.ahead_stats, (stage.aux, stage.moe_raw) = (stage.aux, stage.moe_raw), mine
                caches[i, c] = (version, ahead, cache)  # ahead: the cache names its weights
                caches_held += 1
                self.peak_held = max(self.peak_held, caches_held)
                self._event("F", i, c, t0)
                if self.on_forward is not None:
                    held = tuple(sorted((ch, mine - self.updates, run_ahead, xs[mb].shape)
                                        for (mb, ch), (mine, run_ahead, _) in caches.items()))
                    if held not in self.measured:
                        self.measured.add(held)
                        self.on_forward(caches)
                if c == n_chunks - 1 and ahead:  # the next step's loss
                    self.ahead_loss += float(out)
                elif c == n_chunks - 1:
                    loss += float(out)
                else:
                    self._send(out, shape, mb_tag, c + 1, grad=False,
                               pending=self.pending if ahead else pending)
            elif a.kind == "B":
                dout = None if c == n_chunks - 1 else self._recv(shape, mb_tag, c, grad=True)
                t0 = time.perf_counter()
                made_on, released, cache = caches.pop((i, c))
                if stashing:  # the rule, stated apart from the forward's choice
                    version = pipedream_version(P, rank, self.updates)
                if (delayed or stashing) and made_on != version:
                    raise AssertionError(f"rank {rank}: micro-batch {i}'s backward on "
                                         f"W({version}), its forward on W({made_on})")
                if stashing:  # the stashed version W(made_on) is what it attaches
                    on = self.stashed(made_on)
                dx, todo = stage.backward(c, dout, cache, (i, c) in split, final, dloss,
                                          attach_weights=released,  # batch t+1's wait
                                          sink=self.stash if ahead else None,
                                          weights=self.weights(on))
                self.stash_bytes = max(self.stash_bytes, self.stash.nbytes())
                if (i, c) in split:
                    todos[i, c] = todo
                else:
                    caches_held -= 1
                self._event("B", i, c, t0)
                if dx is not None:
                    self._send(dx, shape, mb_tag, c - 1, grad=True,
                               pending=self.pending if ahead else pending)
            else:  # W
                t0 = time.perf_counter()
                stage.weight(todos.pop((i, c)), final)
                caches_held -= 1
                self._event("W", i, c, t0)
        self.carry_on = len(xs) > m
        t0 = time.perf_counter()
        self.comm.recorder.microbatch = -1
        # sends are finished at the end of the step (their buffers stay alive in the lists
        # until here); 2BW's of batch t+1 at the end of the next step, which runs the rest
        # of batch t+1 on every rank, so their receivers have taken them by then
        wait_all([req for req, _ in pending])
        self._event("send", -1, -1, t0)
        self.carry = {(i - m, c): v for (i, c), v in caches.items() if i >= m}
        assert len(self.carry) == len(caches) and not todos, "a micro-batch's cache was left over"
        if delayed:  # the update makes W(t+1) of W(t)
            sharder.keep_previous()
        if stashing:  # keep W(t) for the carried caches; drop what no cache names
            made = {v for v, _, _ in self.carry.values()}
            self.versions = {k: b for k, b in self.versions.items() if k in made}
            if self.updates in made:
                self.versions[self.updates] = {u: b.copy() for u, b in sharder.pbuf.items()}
            self.version_bytes = max(self.version_bytes, sum(
                int(b.nbytes) for bufs in self.versions.values() for b in bufs.values()))
        if delayed or stashing:
            self.updates += 1
        return loss
