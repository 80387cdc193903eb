"""Where collectives run: side streams and events on accelerators, async work handles on CPU
(the do-nothing case: no streams, no events). The stream timeline is in docs/design.md.

* ``all_gather_stream``: copy-in and all-gather, so the next group's gather overlaps compute.
* ``reduce_scatter_stream``: the reduce-scatter, so it overlaps the rest of backward.

No ``record_stream``: the all-gather output is dropped once its copy-out is queued, as the
all-gather stream allocates again only after `CommContext.on` made it wait for the compute stream;
the reduce-scatter input is held by its `Pending` until the compute stream waits for its event.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import watchdog
from .collective import Collective, CollectiveObserver


@dataclass
class Pending:
    """A collective in flight: its work handle (CPU) or completion event (accelerator), and the
    buffers it reads or writes (``keep_alive``) until it is waited on."""

    work: dist.Work | None = None
    event: torch.Event | None = None
    keep_alive: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    # CPU: what needs the collective's result, run by the thread that waits (`CommContext.settle`).
    after: Callable[[], None] | None = None
    what: object = "a collective"  # how the watchdog names it (a `Collective`, formatted only then)
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
            torch.accelerator.current_stream().wait_event(self.event)
            self.event = None
        after, self.after = self.after, None
        if after is not None:
            after()

    def discard(self) -> None:
        """Let the collective land and drop everything, without running ``after``."""
        self.after = None
        self.wait()
        self.keep_alive = ()

    def release(self) -> None:
        """Wait for the collective (if nobody has) and drop its buffers."""
        with self._wait_lock:
            if self.work is not None:
                self.work.wait()
                self.work = None
            self.keep_alive = ()


class Releaser:
    """Drops a CPU collective's buffers as soon as it lands, e.g. a reduce-scatter's gradient input
    while backward computes the next block. Gloo's work has no future to hang a callback on, so one
    daemon thread per `CommContext` (started on first use) waits in issue order, gloo's order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, pending: Pending) -> None:
        if pending.work is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=_drain, args=(self._queue,), name="fully_shard-release", daemon=True
            )
            self._thread.start()
        self._queue.put(pending)

    def close(self) -> None:
        self._queue.put(None)


def _drain(work_queue: queue.SimpleQueue[Pending | None]) -> None:
    # Holds only the queue, so the thread stops once its `CommContext` is collected.
    while (pending := work_queue.get()) is not None:
        pending.release()


class CommContext:
    """The streams of one device, shared by every group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type not in ("cpu", "meta")  # meta: a simulated step (fully_shard.plan)
        self.all_gather_stream: torch.Stream | None = None
        self.reduce_scatter_stream: torch.Stream | None = None
        if self.uses_streams:
            # High priority: collectives gate compute, so let them jump the queue.
            self.all_gather_stream = torch.Stream(device=device, priority=-1)
            self.reduce_scatter_stream = torch.Stream(device=device, priority=-1)
        self.observers: list[CollectiveObserver] = []
        # Accelerators overlap through streams (the side stream waits for the collective), the CPU
        # through async work handles.
        self.async_op = not self.uses_streams
        self.releaser = Releaser()
        weakref.finalize(self, self.releaser.close)

    def settle(self, pending: Pending, after: Callable[[], None]) -> None:
        """A collective was just issued on the current stream: run ``after`` once it lands and free
        its buffers early. Accelerator: queue ``after`` now (stream order puts it behind the
        collective) and record the event waiters wait on. CPU: the waiting thread runs ``after``;
        the releaser drops the buffers the moment the collective lands."""
        if self.uses_streams:
            after()
            pending.event = torch.accelerator.current_stream(self.device).record_event()
        else:
            pending.after = after
            self.releaser.submit(pending)

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
            stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            yield

    def issue(self, c: Collective, run: Callable[[], dist.Work | None]) -> dist.Work | None:
        """Show ``c`` to every observer before ``run`` issues it (one may raise: then nothing is
        issued) and after."""
        for o in self.observers:
            o.before(c)
        work = run()
        for o in self.observers:
            o.after(c)
        return work
