"""The synchronous executor: one training step of a flush schedule, a rank's action list
interpreted over MPI (naive, GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV).

Shapes: b_i rows of micro-batch i, T time, C channels; pp ranks, S chunks (chunk c on rank
ChunkPlacement.rank(c): c % pp, or in a V). T is the tokens of a sequence this rank holds
(T/cp with context parallelism); with sequence parallelism a boundary carries (b_i, T/tp, C)
(Korthikanti et al. 2022, sec. 4.2: the block's output is already sharded along T), so SP
divides these bytes by tp.

Communication (on grid.comm["pp"]), implied by the chunk graph (schedules.py), named as
Megatron names it:
  recv_forward   before F(i, c), c > 0:    chunk c's input, from chunk c-1's rank
  send_forward   after F(i, c), c < S-1:   the output (b_i, T, C), to chunk c+1's rank
  recv_backward  before B(i, c), c < S-1:  the gradient of chunk c's output, from c+1's rank
  send_backward  after B(i, c), c > 0:     the input gradient (b_i, T, C), to chunk c-1's rank
(in a V the turn, chunk pp-1 to pp, is a message a rank sends itself).
Sends are nonblocking (finished at the end of the step), so a rank blocks only in a receive,
and only on the message its next action needs: the simulator proved such lists complete.
Receives sleep between tests (Comm.recv). Each receive makes a new array that belongs to one
micro-batch's cache; no buffer is reused, so no cache can alias another micro-batch's data.
The receiver states the shape and dtype it expects (Comm.recv refuses a message of another
size).

The tag is the receiving chunk and the direction, tag(c, grad) = 2c + grad, never the
micro-batch: it stays below 2S however many micro-batches a step has. Why that is safe: MPI
messages do not overtake (MPI standard, sec. 3.5): between two ranks on one communicator, the
k-th receive posted with a tag matches the k-th message sent with it, and a rank posts its
receives one at a time, in its list's order. Every schedule runs each chunk's forwards, and
its backwards, in micro-batch order (the asynchronous ones across steps too), so the messages
into one chunk in one direction are sent in the order they are received. The direction is
needed: in a V, rank r sends rank r+1 both an activation (into chunk r+1) and a gradient
(into chunk 2pp-2-r). The chunk keeps the argument to one chunk's order, whatever order a
schedule gives different chunks on neighbouring ranks. test_pipeline_schedules.py checks
every schedule's streams. The tied embedding's swap (32767) and the fault hook's receive
(32766) use tags no pipeline message has.

The step ends with every gradient of the step's batch accumulated (the flush): the
asynchronous schedules, which do not flush, build on this class in asynchronous.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from refmp.distributed.comm import Comm
from refmp.distributed.waiting import wait_all
from refmp.parallel.pipeline.schedules import Action, ChunkPlacement, Event
from refmp.parallel.pipeline.stage import Stage


def tag(chunk: int, grad: bool) -> int:
    """The tag of a message into chunk ``chunk``: its input (an activation) or, with ``grad``,
    its output's gradient. One per (receiving chunk, direction); see the module docstring."""
    return 2 * chunk + int(grad)


class Executor:
    """Runs action lists for one Stage over the pp communicator, timing every action.

    ``dtype``: the activations' (what crosses a stage boundary); ``on_forward``, if given, is
    called with the live caches after a forward (the engine measures their bytes) whenever
    they are a new set: one not seen before as each cache's chunk and micro-batch shape,
    which fix the bytes (walking the caches costs 0.1 ms, on the pipeline's critical path,
    every forward); ``placed``: which rank runs each chunk (default: c % pp)."""

    fills = True  # each step starts from an empty pipeline (the asynchronous ones: not always)

    def __init__(self, stage: Stage, comm: Comm, dtype, on_forward: Callable[[dict], None] | None = None,
                 placed: ChunkPlacement | None = None):
        self.stage = stage
        self.comm = comm
        self.dtype = dtype
        self.on_forward = on_forward
        self.placed = placed or ChunkPlacement(comm.size)
        self.events: list[Event] = []  # the last step's timeline on this rank
        self.peak_held = 0  # most micro-batch caches held at once in the last step
        self.measured: set[tuple] = set()  # the sets of caches on_forward has seen

    # --- the four messages of a pipeline --------------------------------------------------------

    def recv_forward(self, shape, mb: int, chunk: int):
        """Chunk ``chunk``'s input for micro-batch ``mb``: chunk-1's output."""
        return self._recv(shape, mb, chunk, grad=False)

    def send_forward(self, out, shape, mb: int, chunk: int, pending: list) -> None:
        """Chunk ``chunk``'s output to the rank of chunk+1 (nonblocking: into ``pending``)."""
        self._send(out, shape, mb, chunk + 1, grad=False, pending=pending)

    def recv_backward(self, shape, mb: int, chunk: int):
        """The gradient of chunk ``chunk``'s output: chunk+1's input gradient."""
        return self._recv(shape, mb, chunk, grad=True)

    def send_backward(self, dx, shape, mb: int, chunk: int, pending: list) -> None:
        """The gradient of chunk ``chunk``'s input to the rank of chunk-1."""
        self._send(dx, shape, mb, chunk - 1, grad=True, pending=pending)

    def _send(self, x, shape, mb: int, chunk: int, grad: bool, pending: list) -> None:
        t0 = time.perf_counter()
        dest = self.placed.rank(chunk)
        if x.shape != shape or x.dtype != self.dtype:  # the receiver expects exactly this
            raise ValueError(f"rank {self.comm.rank}: micro-batch {mb} for chunk {chunk} is "
                             f"{x.shape} {x.dtype}, expected {shape} {self.dtype}")
        pending.append((self.comm.send(x, dest, tag(chunk, grad)), x))
        self._event("send", mb, chunk, t0)

    def _recv(self, shape, mb: int, chunk: int, grad: bool):
        t0 = time.perf_counter()
        src = self.placed.rank(chunk + (1 if grad else -1))
        x = self.comm.recv(shape, self.dtype, src, tag(chunk, grad))
        self._event("recv", mb, chunk, t0)
        return x  # a fresh array, owned by micro-batch mb alone

    def _event(self, kind: str, mb: int, chunk: int, t0: float) -> None:
        self.events.append(Event(self.comm.rank, kind, mb, chunk, t0, time.perf_counter()))

    def _measure(self, caches: dict, key: tuple) -> None:
        """on_forward, for a set of live caches (``key``: what fixes their bytes) not seen."""
        if self.on_forward is not None and key not in self.measured:
            self.measured.add(key)
            self.on_forward(caches)

    # --- one step -------------------------------------------------------------------------------

    def step(self, actions: list[Action], xs: list, ys: list, denom: int, m: int) -> float:
        """Run one step's actions; xs[i], ys[i]: micro-batch i's (b_i, T) ids and targets, the
        step's ``m`` (all here). Returns this rank's loss share (non-zero on the last chunk's)."""
        stage = self.stage
        last = stage.n_chunks - 1  # the chunk with the head and the loss
        final_mb = m - 1  # the step's last micro-batch
        split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}  # B's whose W is listed
        caches: dict = {}  # (micro-batch, chunk) -> the forward's cache, until its backward
        todos: dict = {}  # (micro-batch, chunk) -> what a split backward left for its W
        pending: list = []  # the step's sends, finished at its end
        loss = 0.0
        self.events = []
        self.peak_held = 0
        for a in actions:
            i, c = a.mb, a.chunk
            self.comm.recorder.microbatch = i  # the flight recorder's label of each call
            shape = stage.act_shape(*xs[i].shape)  # (b_i, T, C); T/tp with SP
            if a.kind == "F":
                inp = xs[i] if c == 0 else self.recv_forward(shape, i, c)
                t0 = time.perf_counter()
                out, caches[i, c] = stage.forward(c, inp, ys[i], denom)
                self._event("F", i, c, t0)
                self.peak_held = max(self.peak_held, len(caches) + len(todos))
                self._measure(caches, tuple(sorted((ch, xs[mb].shape) for mb, ch in caches)))
                if c == last:
                    loss += float(out)
                else:
                    self.send_forward(out, shape, i, c, pending)
            elif a.kind == "B":
                dout = None if c == last else self.recv_backward(shape, i, c)
                t0 = time.perf_counter()
                dx, todo = stage.backward(c, dout, caches.pop((i, c)), (i, c) in split,
                                          final=i == final_mb)
                if (i, c) in split:
                    todos[i, c] = todo
                self._event("B", i, c, t0)
                if dx is not None:
                    self.send_backward(dx, shape, i, c, pending)
            else:  # W: the weight gradients its B left
                t0 = time.perf_counter()
                stage.weight(todos.pop((i, c)), final=i == final_mb)
                self._event("W", i, c, t0)
        self.comm.recorder.microbatch = -1
        t0 = time.perf_counter()
        wait_all([req for req, _ in pending])  # the buffers stayed alive in the list until here
        self._event("send", -1, -1, t0)
        assert not caches and not todos, "a micro-batch's cache was left over"
        return loss

    def memory(self) -> dict[str, int]:
        """Bytes this executor keeps between steps, by kind: none (a flush leaves nothing)."""
        return {}

    def resident(self) -> list:
        """Weight buffers this executor keeps (caches may reference them): none."""
        return []
