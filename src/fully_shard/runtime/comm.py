"""Where collectives run: side streams and events on accelerators, async work handles on CPU.

The CPU is the do-nothing case of the accelerator path: the same calls, with no streams and no
events. On an accelerator:

* ``all_gather_stream`` — copy-in and the all-gather, so the next group's gather overlaps the
  current group's compute (prefetch). It waits for the compute stream before each copy-in, so it
  reads shards the optimizer has finished writing.
* ``reduce_scatter_stream`` — the reduce-scatter, so it overlaps the rest of backward.

No ``record_stream``. A buffer allocated on one stream and used on another is safe to drop once
the stream that allocated it has waited for the user:

* the all-gather output (allocated on the all-gather stream, read by the copy-out on the compute
  stream) is dropped right after the copy-out is queued: the all-gather stream allocates again
  only inside `CommContext.on`, which first makes it wait for every compute-stream op queued so
  far, the copy-out included;
* the reduce-scatter input (allocated on the compute stream, read on the reduce-scatter stream)
  is held by its `Pending` until the compute stream waits for the reduce-scatter's event.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from . import watchdog
from .collective import Collective, CollectiveObserver


@dataclass
class Pending:
    """A collective in flight: its work handle (CPU) or completion event (accelerator).

    ``keep_alive`` holds buffers the collective reads or writes until it is waited on.
    """

    work: Optional[dist.Work] = None
    event: Optional[torch.Event] = None
    keep_alive: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    # CPU: work that needs the collective's result, run by the thread that waits (see `CommContext.settle`).
    after: Optional[Callable[[], None]] = None
    what: object = "a collective"  # how the watchdog names it (a `Collective`, formatted only then)
    # Exactly one thread may wait on a work: gloo's composite collectives finish writing their
    # output inside wait(), so a second, concurrent wait() can return before the data is there.
    _wait_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def wait(self) -> None:
        """Make the caller (CPU thread, or the current stream) wait for the collective, then run
        what was waiting for its result."""
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
        """Let the collective land and drop everything, without running what waited for it."""
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
    """Drops a CPU collective's buffers as soon as it completes, rather than when someone waits.

    For a CPU reduce-scatter this frees the gradient input buffer while backward computes the
    next block, instead of one block later. Gloo's reduce-scatter work has no future to hang a
    callback on, so a thread has to wait for it (``Work.wait`` releases the GIL). One long-lived
    daemon thread per `CommContext`, started on first use, waits in issue order (the order gloo
    runs them in); it holds only its queue, and stops when the `CommContext` is collected.
    """

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Optional[Pending]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

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


def _drain(work_queue: "queue.SimpleQueue[Optional[Pending]]") -> None:
    while (pending := work_queue.get()) is not None:
        pending.release()


class CommContext:
    """The streams of one device, shared by every group under one root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uses_streams = device.type not in ("cpu", "meta")  # meta: a simulated step (fully_shard.plan)
        self.all_gather_stream: Optional[torch.Stream] = None
        self.reduce_scatter_stream: Optional[torch.Stream] = None
        if self.uses_streams:
            # High priority: collectives gate compute, so let them jump the queue.
            self.all_gather_stream = torch.Stream(device=device, priority=-1)
            self.reduce_scatter_stream = torch.Stream(device=device, priority=-1)
        # Who watches the collectives issued under this root: traces, the schedule check.
        self.observers: list[CollectiveObserver] = []
        # CPU: overlap through async work handles. Accelerator: through streams, with the side
        # stream itself waiting for the collective (so events order everything).
        self.async_op = not self.uses_streams
        self.releaser = Releaser()
        weakref.finalize(self, self.releaser.close)

    def settle(self, pending: Pending, after: Callable[[], None]) -> None:
        """A collective was just issued on the current (side) stream: run ``after`` (work that
        needs its result) once it lands, and free its buffers as early as possible.

        The one path for both kinds of device. Accelerator: ``after`` is queued now on this stream,
        which orders it behind the collective, and waiters wait on the event recorded after it.
        CPU (no streams): ``after`` runs in the thread that waits for ``pending``; the releaser
        drops the buffers the moment the collective lands.
        """
        if self.uses_streams:
            after()
            pending.event = self.record(torch.accelerator.current_stream(self.device))
        else:
            pending.after = after
            self.releaser.submit(pending)

    @contextlib.contextmanager
    def on(self, stream: Optional[torch.Stream], after: Optional[torch.Event] = None) -> Iterator[None]:
        """Run the body on ``stream`` after it waits for the current stream's work so far, or
        only for ``after`` when given (a post-optimizer event: safe because everything the
        side stream's buffers were read by was queued before the optimizer step)."""
        if stream is None:
            yield
            return
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            yield

    def record(self, stream: Optional[torch.Stream] = None) -> Optional[torch.Event]:
        if not self.uses_streams:
            return None
        stream = stream if stream is not None else torch.accelerator.current_stream(self.device)
        return stream.record_event()

    def issue(self, c: Collective, run: Callable[[], Optional[dist.Work]]) -> Optional[dist.Work]:
        """The one way a collective is issued: every observer sees ``c`` before ``run`` issues it
        (one may raise; then nothing is issued) and after."""
        for o in self.observers:
            o.before(c)
        work = run()
        for o in self.observers:
            o.after(c)
        return work
