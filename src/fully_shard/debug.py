"""A collective trace users can turn on: every all-gather and reduce-scatter, with why it ran.

    with fully_shard.debug.trace() as t:
        loss = model(x).sum()
        loss.backward()
    print(t.summary())

It sees every root whose forward (or ``unshard``) starts inside the block. Active traces are a
``ContextVar``, so ranks run as threads of one process each see only their own.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .runtime.collective import ACTIVE_OBSERVERS, Collective

# Public as fully_shard.debug.*:
from .features.schedule import LateRank, ScheduleDivergence, set_schedule_check  # noqa: F401
from .runtime.watchdog import set_watchdog  # noqa: F401


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank.

    ``step`` counts root forwards in the trace. ``phase`` says why it ran: ``forward``, ``backward``,
    ``forward_prefetch``, ``backward_prefetch``, ``explicit`` (``unshard``), ``unsharded_context``,
    ``end_of_backward`` (no post-backward signal fired for that group), or with ``dtensor=True``
    ``dtensor_forward`` / ``dtensor_backward``. ``nbytes``: all-gather output / reduce-scatter input.
    """

    step: int
    phase: str
    module: str
    op: str
    dtype: torch.dtype
    nbytes: int
    group_size: int
    group_name: str
    # Reductions: "sum", "avg" or "premul_sum", and our divisions of the input and the output.
    reduce_op: str = ""
    pre_divide: float = 1.0
    post_divide: float = 1.0
    rank_span: tuple[int, int] = (0, 0)  # lowest and highest global rank: the nodes it spans


@dataclass(eq=False)
class Trace:
    """The records of a `trace` block; filter them with `select` / `count`."""

    records: list[CollectiveRecord] = field(default_factory=list)
    step: int = 0
    memory: Any = None  # trace(memory=True): a `tools.memory.TraceMemory`
    _started: bool = False
    _attached: list[Any] = field(default_factory=list)  # the roots (`RootContext`) it watches
    _spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (lowest, highest) global rank

    def begin_step(self) -> None:
        if self._started:
            self.step += 1
        self._started = True

    def before(self, c: Collective) -> None: ...

    def after(self, c: Collective) -> None:
        """A collective of a root this trace watches was issued."""
        span = self._spans.get(c.group.group_name)
        if span is None:  # once per group
            ranks = dist.get_process_group_ranks(c.group)
            span = self._spans[c.group.group_name] = (min(ranks), max(ranks))
        r = c.reduction
        extra = ("", 1.0, 1.0) if r is None else (r.name, r.before, r.after)
        self.add_record(
            c.reason.value,
            c.modules or "<root>",
            c.op.value,
            c.dtype,
            c.nbytes,
            c.group.size(),
            c.group.group_name,
            *extra,
            rank_span=span,
        )

    def attach(self, root: Any) -> None:
        """A root (`RootContext`) started work inside this trace."""
        if root not in self._attached:
            self._attached.append(root)
        if self.memory is not None:
            self.memory.attach(root.states)

    def add_record(
        self,
        phase: str,
        module: str,
        op: str,
        dtype: torch.dtype,
        nbytes: int,
        group_size: int,
        group_name: str,
        reduce_op: str = "",
        pre_divide: float = 1.0,
        post_divide: float = 1.0,
        rank_span: tuple[int, int] = (0, 0),
    ) -> None:
        self.records.append(
            CollectiveRecord(
                self.step,
                phase,
                module,
                op,
                dtype,
                nbytes,
                group_size,
                group_name,
                reduce_op,
                pre_divide,
                post_divide,
                rank_span,
            )
        )
        if self.memory is not None:
            self.memory.snapshot(f"{phase} {op} {module}", op, nbytes)

    def select(
        self,
        *,
        op: Optional[str] = None,
        phase: Optional[str] = None,
        step: Optional[int] = None,
        module: Optional[str] = None,
    ) -> list[CollectiveRecord]:
        wanted = {"op": op, "phase": phase, "step": step, "module": module}
        return [r for r in self.records if all(v is None or getattr(r, k) == v for k, v in wanted.items())]

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
            modules = ", ".join(
                f"{m}x{n}" if n > 1 else m for m, n in Counter(r.module for r in recs).items()
            )
            lines.append(f"{step:>4}  {phase:<18} {op:<15} {size:>5} {len(recs):>5} {mib:>10.3f}  {modules}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


@contextlib.contextmanager
def trace(
    dtensor: bool = False, memory: bool = False, optimizers: Sequence[torch.optim.Optimizer] = ()
) -> Iterator[Trace]:
    """Record the collectives of every root whose forward or unshard starts inside this block.

    ``dtensor=True`` also records DTensor's own collectives in this thread (tensor/sequence parallel).
    ``memory=True`` counts live tensor bytes on the model's device (``t.memory``, snapshots by
    category at every collective; ``optimizers`` own the optimizer state; ``fully_shard.plan.draw``
    draws it). Both watch every op, so they slow the step."""
    t = Trace()
    token = ACTIVE_OBSERVERS.set(ACTIVE_OBSERVERS.get() + (t,))
    try:
        with contextlib.ExitStack() as modes:
            if dtensor:
                from .tools.funcol_trace import FunctionalCollectiveTrace

                modes.enter_context(FunctionalCollectiveTrace(t))
            if memory:
                from .tools.memory import TraceMemory

                t.memory = TraceMemory(optimizers)
                modes.enter_context(t.memory.counter)
            yield t
    finally:
        ACTIVE_OBSERVERS.reset(token)
        for root in t._attached:
            root.detach(t)
        t._attached.clear()
