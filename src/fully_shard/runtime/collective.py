"""A collective as a value (`Collective`), why it runs (`Reason`), and who watches it
(`CollectiveObserver`, called by `CommContext.issue`). Imports: torch only."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .collectives import Reduction


class Op(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


class Reason(str, Enum):
    """Why a collective runs (traces show the value as ``CollectiveRecord.phase``)."""

    FORWARD = "forward"
    FORWARD_PREFETCH = "forward_prefetch"
    BACKWARD = "backward"
    BACKWARD_PREFETCH = "backward_prefetch"
    EXPLICIT = "explicit"  # FSDPModule.unshard()
    UNSHARDED_CONTEXT = "unsharded_context"  # fully_shard.unsharded(model)
    END_OF_BACKWARD = "end_of_backward"  # reduced by the end-of-backward callback: no signal fired
    REDUCE_GRADS = "reduce_grads"  # FSDPModule.reduce_grads(): a backward finished by hand

    @property
    def forward(self) -> bool:
        return self in (Reason.FORWARD, Reason.FORWARD_PREFETCH)


# Only these gather a whole bucket and rely on the root's forward start to run `notice_changes`.
HOOK_DRIVEN = frozenset({Reason.FORWARD, Reason.FORWARD_PREFETCH, Reason.BACKWARD, Reason.BACKWARD_PREFETCH})


@dataclass(frozen=True)
class Collective:
    """One collective this rank is about to issue. ``modules``: the group(s) it serves, joined by
    ``+``; ``nbytes``: the all-gather output / reduce-scatter input on this rank."""

    op: Op
    reason: Reason
    modules: str
    dtype: torch.dtype
    nbytes: int
    group: dist.ProcessGroup
    reduction: Reduction | None = None

    def describe(self) -> str:
        """For errors and the watchdog: ``all_gather of 'blocks.1' (float32, 512 bytes)``."""
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.op.value} of '{self.modules or '<root>'}' ({dtype}, {self.nbytes} bytes)"

    def __str__(self) -> str:
        return f"the {self.op.value} of '{self.modules or '<root>'}' ({self.reason.value})"


class CollectiveObserver(Protocol):
    """Watches a root's collectives (`CommContext.observers`); the comm layer calls it and never
    imports it. ``before`` may raise, and then the collective is not issued."""

    def begin_step(self) -> None: ...

    def before(self, c: Collective) -> None: ...

    def after(self, c: Collective) -> None: ...

    def attach(self, root: Any) -> None:
        """A root (`RootContext`) whose work started in this observer's context."""


# Observers opened in this thread (``fully_shard.debug.trace()``), attached by a root when its work
# starts here. Per thread, so ranks run as threads each see only their own.
ACTIVE_OBSERVERS: ContextVar[tuple[CollectiveObserver, ...]] = ContextVar("fully_shard_observers", default=())
