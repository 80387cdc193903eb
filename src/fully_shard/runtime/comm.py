"""Where collectives run: side streams and events on accelerators, async work handles on CPU
(the do-nothing case: no streams, no events). The stream timeline is in docs/design.md.

* ``all_gather_stream``: copy-in and all-gather, so the next group's gather overlaps compute.
* ``reduce_scatter_stream``: the reduce-scatter, so it overlaps the rest of backward.

No ``record_stream``: the all-gather output is dropped once its copy-out is queued, as the
all-gather stream allocates again only after `CommContext.on` made it wait for the compute stream;
the reduce-scatter input is held by its `Pending` until the compute stream waits for its event.

Streams and events come from `DeviceStreams` (``torch.Stream`` / ``torch.accelerator``). A test
mode can install stand-ins for CPU meshes (`set_cpu_streams`, used by
``fully_shard.tools.stream_check``): the same accelerator branch then runs on CPU tensors while a
checker orders every access.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import watchdog
from .collective import Collective, CollectiveObserver

# Collectives a CPU root lets run at once. 0: on gloo, overlap saved at most ~3% of a step in
# docs/benchmarks.md while a running all-gather holds a staging copy of its output; 0 keeps the peak
# at or below PyTorch's on every model there.
DEFAULT_IN_FLIGHT = 0


@dataclass
class Pending:
    """A collective in flight: its work handle (CPU) or completion event (accelerator), and the
    buffers it reads or writes (``keep_alive``) until it is waited on (an all-gather's output, read
    by its copy-out, until then)."""

    work: dist.Work | None = None
    event: torch.Event | None = None
    keep_alive: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    # CPU: what needs the collective's result, run by the thread that waits (`CommContext.settle`).
    after: Callable[[], None] | None = None
    what: object = "a collective"  # how the watchdog names it (a `Collective`, formatted only then)
    keeps_output: bool = False  # an all-gather: ``keep_alive[0]`` is read after the wait
    # One waiter per work: gloo's composite collectives finish writing their output inside wait(),
    # so a second, concurrent wait() can return before the data is there.
    _wait_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def wait(self) -> None:
        """Make the caller (CPU thread, or the current stream) wait, then run ``after``."""
        if self.work is not None:
            with self._wait_lock:
                if self.work is not None:
                    seconds = watchdog.timeout  # read once: None (off) means nothing else on this path
                    if seconds is None:
                        self.work.wait()
                    else:
                        watchdog.wait(self.work, self.what, seconds)
                    self.work = None
        if self.event is not None:
            self.event.wait()  # the current stream waits
            self.event = None
        if not self.keeps_output:  # what it read dies before what needs its result runs
            self.keep_alive = ()
        after, self.after = self.after, None
        if after is not None:
            after()

    def discard(self) -> None:
        """Let the collective land and drop everything, without running ``after``."""
        self.after = None
        self.wait()
        self.keep_alive = ()

    def done(self) -> bool:
        return self.work is None and self.after is None


class DeviceStreams:
    """An accelerator's streams: new side streams and the current one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, name: str) -> torch.Stream:
        # High priority: collectives gate compute, so let them jump the queue.
        return torch.Stream(device=self.device, priority=-1)

    def current(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)


# A test mode's stand-in streams for CPU meshes (`set_cpu_streams`); None: CPU uses none.
_cpu_streams: Callable[[torch.device], Any] | None = None


def set_cpu_streams(factory: Callable[[torch.device], Any] | None) -> None:
    """From now on, a `CommContext` made for a CPU mesh takes its streams from ``factory(device)``
    (an object with `DeviceStreams`' methods) and runs the accelerator branch; None turns it off."""
    global _cpu_streams
    _cpu_streams = factory


class CommContext:
    """The streams of one device, shared by every group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams: Any = None  # meta: a simulated step (fully_shard.plan), no streams
        if device.type == "cpu":
            self.streams = _cpu_streams(device) if _cpu_streams is not None else None
        elif device.type != "meta":
            self.streams = DeviceStreams(device)
        self.uses_streams = self.streams is not None
        self.all_gather_stream: torch.Stream | None = None
        self.reduce_scatter_stream: torch.Stream | None = None
        if self.uses_streams:
            self.all_gather_stream = self.streams.new_stream("all_gather")
            self.reduce_scatter_stream = self.streams.new_stream("reduce_scatter")
        self.observers: list[CollectiveObserver] = []
        # Accelerators overlap through streams (the side stream waits for the collective), the CPU
        # through async work handles, at most ``limit`` at once (``set_collectives_in_flight``).
        self.async_op = not self.uses_streams
        self.in_flight: deque[Pending] = deque()
        self.set_limit(DEFAULT_IN_FLIGHT)

    def set_limit(self, n: int) -> None:
        """CPU: at most ``n`` collectives in flight; below 2 a reduce-scatter completes before the
        next module's backward computes. Streams overlap whatever ``n`` is."""
        self.limit = n
        self.reduce_overlaps_compute = self.uses_streams or n >= 2

    def settle(self, pending: Pending, after: Callable[[], None]) -> None:
        """A collective was just issued on the current stream: run ``after`` once it lands.
        Accelerator: queue it now (stream order puts it behind the collective) and record the event
        waiters wait on. CPU: whoever completes the collective runs it (`Pending.wait`)."""
        if self.uses_streams:
            after()
            pending.event = self.streams.current().record_event()
        else:
            pending.after = after

    def track(self, pending: Pending) -> None:
        """Count an issued CPU collective; with a limit of 0, complete it now."""
        if pending.work is not None:
            self.in_flight.append(pending)
            if self.limit == 0:
                self.in_flight.popleft().wait()

    def make_room(self) -> None:
        """Before a collective is issued: complete the oldest until fewer than ``limit`` (one at
        least) are in flight, so the buffers alive at once are bounded by rule, not by timing."""
        in_flight, room = self.in_flight, max(self.limit, 1)
        while in_flight and (in_flight[0].done() or len(in_flight) >= room):
            in_flight.popleft().wait()

    @contextlib.contextmanager
    def on(self, stream: torch.Stream | None, after: torch.Event | None = None) -> Iterator[None]:
        """Run the body on ``stream`` after it waits for the current stream, or only for ``after``:
        a post-optimizer event, enough since all readers of the side stream's buffers were queued
        before the optimizer step."""
        if stream is None:
            yield
            return
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(self.streams.current())
        with stream:
            yield

    def issue(self, c: Collective, run: Callable[[], dist.Work | None]) -> dist.Work | None:
        """Show ``c`` to every observer before ``run`` issues it (one may raise: then nothing is
        issued) and after."""
        if self.in_flight:
            self.make_room()
        for o in self.observers:
            o.before(c)
        work = run()
        for o in self.observers:
            o.after(c)
        return work
