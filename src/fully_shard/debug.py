"""A collective trace users can turn on: every all-gather and reduce-scatter, with why it ran.

    with fully_shard.debug.trace() as t:
        loss = model(x).sum()
        loss.backward()
    print(t.summary())

A trace attaches to every root whose forward (or explicit ``unshard``) starts inside the
``with`` block, and from then on sees all of that root's collectives, including those issued from
backward on an accelerator's autograd thread. Which traces are active is a ``ContextVar``, so
ranks that run as threads of one process each see only their own.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from .schedule import ScheduleDivergence, set_schedule_check, set_watchdog  # noqa: F401  (public: fully_shard.debug.*)

if TYPE_CHECKING:
    from .collectives import Reduction


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank.

    ``step`` counts root forwards inside the trace (0, 1, ...). ``phase`` says why it ran:
    ``forward``, ``backward``, ``forward_prefetch``, ``backward_prefetch``, ``explicit``
    (``FSDPModule.unshard``), ``unsharded_context``, or ``end_of_backward`` (a reduce-scatter the
    end-of-backward callback issued because no post-backward signal fired for that group); with
    ``trace(dtensor=True)`` also ``dtensor_forward`` / ``dtensor_backward`` (DTensor's own
    collectives, e.g. tensor parallel's; ``module`` is then the innermost module running).
    ``nbytes`` is the size of the all-gather output / reduce-scatter input on this rank.
    """

    step: int
    phase: str
    module: str
    op: str
    dtype: torch.dtype
    nbytes: int
    group_size: int
    group_name: str
    # Reductions: the collective's reduce op ("sum", "avg", "premul_sum") and the divisions we do
    # around it (a reduce-scatter's ``pre_divide`` applies to its input, ``post_divide`` to the output).
    reduce_op: str = ""
    pre_divide: float = 1.0
    post_divide: float = 1.0
    # The lowest and highest global rank in the group (which nodes it spans: fully_shard.plan's timing).
    rank_span: tuple[int, int] = (0, 0)


@dataclass(eq=False)
class Trace:
    records: list[CollectiveRecord] = field(default_factory=list)
    step: int = 0
    # trace(memory=True): live tensor bytes (`fully_shard.plan.memory.TraceMemory`), a snapshot at each collective.
    memory: Any = None
    _started: bool = False
    _attached: list[list["Trace"]] = field(default_factory=list)  # the observer lists of the roots it watches

    def begin_step(self) -> None:
        if self._started:
            self.step += 1
        self._started = True

    def add(
        self, phase: str, module: str, op: str, dtype: torch.dtype, nbytes: int, group_size: int, group_name: str,
        reduction: Optional["Reduction"] = None, rank_span: tuple[int, int] = (0, 0),
    ) -> None:
        extra = ("", 1.0, 1.0) if reduction is None else (reduction.name, reduction.before, reduction.after)
        self.records.append(
            CollectiveRecord(self.step, phase, module, op, dtype, nbytes, group_size, group_name, *extra, rank_span=rank_span)
        )
        if self.memory is not None:
            self.memory.snapshot(f"{phase} {op} {module}")

    def select(
        self, *, op: Optional[str] = None, phase: Optional[str] = None, step: Optional[int] = None, module: Optional[str] = None
    ) -> list[CollectiveRecord]:
        return [
            r
            for r in self.records
            if (op is None or r.op == op)
            and (phase is None or r.phase == phase)
            and (step is None or r.step == step)
            and (module is None or r.module == module)
        ]

    def count(self, **filters: object) -> int:
        return len(self.select(**filters))  # type: ignore[arg-type]

    def summary(self) -> str:
        """A per-step table: how many collectives of each kind, and how many bytes, per phase."""
        lines = [f"{'step':>4}  {'phase':<18} {'op':<15} {'ranks':>5} {'count':>5} {'MiB':>10}  modules"]
        groups: dict[tuple[int, str, str, int], list[CollectiveRecord]] = {}
        for r in self.records:
            groups.setdefault((r.step, r.phase, r.op, r.group_size), []).append(r)
        for (step, phase, op, size), recs in groups.items():
            mib = sum(r.nbytes for r in recs) / 2**20
            modules = ", ".join(f"{m}x{n}" if n > 1 else m for m, n in Counter(r.module for r in recs).items())
            lines.append(f"{step:>4}  {phase:<18} {op:<15} {size:>5} {len(recs):>5} {mib:>10.3f}  {modules}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


_ACTIVE: ContextVar[tuple[Trace, ...]] = ContextVar("fully_shard_active_traces", default=())


@contextlib.contextmanager
def trace(dtensor: bool = False, memory: bool = False, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Iterator[Trace]:
    """Record the collectives of every root whose forward or unshard starts inside this block.

    ``dtensor=True`` also records DTensor's own collectives run in this thread (tensor and
    sequence parallel layers, redistributes), phase ``dtensor_forward`` / ``dtensor_backward``
    (see `fully_shard.funcol_trace`). ``memory=True`` counts live tensor bytes on the model's
    device (``t.memory``: `fully_shard.plan.LiveBytes` with a snapshot by category at every
    collective; ``optimizers`` name whose state is optimizer state); ``fully_shard.plan.draw(t,
    path)`` draws it. Both watch every op, so they slow the step."""
    t = Trace()
    token = _ACTIVE.set(_ACTIVE.get() + (t,))
    try:
        with contextlib.ExitStack() as modes:
            if dtensor:
                from .funcol_trace import FunctionalCollectiveTrace

                modes.enter_context(FunctionalCollectiveTrace(t))
            if memory:
                from .plan.memory import TraceMemory

                t.memory = TraceMemory(optimizers)
                modes.enter_context(t.memory.counter)
            yield t
    finally:
        _ACTIVE.reset(token)
        for observers in t._attached:
            observers.remove(t)
        t._attached.clear()


def attach_active_traces(ctx: Any) -> None:
    """Called in the user's thread when a root starts work (``ctx``: its `RootContext`): add the
    traces open there to the root's observer list (``CommContext.tracers``), which its
    collectives report to; a memory trace learns the root's model."""
    observers = ctx.comm.tracers
    for t in _ACTIVE.get():
        if t not in observers:
            observers.append(t)
            t._attached.append(observers)
        if t.memory is not None:
            t.memory.attach(ctx.states)
