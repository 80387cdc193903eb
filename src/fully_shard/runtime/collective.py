"""A collective as a value: what is about to run, why, and who watches it.

Every collective fully_shard issues is described once by a frozen `Collective` and handed to
`CommContext.issue`, which calls each observer of the root before and after it runs: the trace
(`fully_shard.debug`), the schedule check (`fully_shard.features.schedule`), and through the trace the
memory counter and the planner. Nothing else announces a collective.

Imports: torch only. Everything that issues or watches collectives imports this.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional, Protocol

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

    @property
    def forward(self) -> bool:
        return self in (Reason.FORWARD, Reason.FORWARD_PREFETCH)


# Driven by the module hooks: only these gather a whole bucket (bucket.py), and only these rely on
# the root's forward start to have looked for changes (`FSDPParamGroup.notice_changes`).
HOOK_DRIVEN = frozenset({Reason.FORWARD, Reason.FORWARD_PREFETCH, Reason.BACKWARD, Reason.BACKWARD_PREFETCH})


@dataclass(frozen=True)
class Collective:
    """One collective this rank is about to issue. ``modules`` names the group(s) it serves (joined
    by ``+`` for a bucket); ``nbytes`` is the all-gather output / reduce-scatter input on this rank."""

    op: Op
    reason: Reason
    modules: str
    dtype: torch.dtype
    nbytes: int
    group: dist.ProcessGroup
    reduction: Optional["Reduction"] = None

    def describe(self) -> str:
        """As errors and the watchdog name it: ``all_gather of 'blocks.1' (float32, 512 bytes)``."""
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.op.value} of '{self.modules or '<root>'}' ({dtype}, {self.nbytes} bytes)"

    def __str__(self) -> str:
        """How a wait names it: ``the all_gather of 'blocks.1' (forward)``."""
        return f"the {self.op.value} of '{self.modules or '<root>'}' ({self.reason.value})"


class CollectiveObserver(Protocol):
    """Watches the collectives of the roots it is attached to (`CommContext.observers`). The comm
    layer calls it and never imports it. ``before`` may raise: the collective is then not issued."""

    def begin_step(self) -> None: ...

    def before(self, c: Collective) -> None: ...

    def after(self, c: Collective) -> None: ...

    def attach(self, root: Any) -> None:
        """A root (`RootContext`) whose work started in this observer's context."""


# Observers opened in this thread (``fully_shard.debug.trace()``): a root attaches them when its
# forward or an explicit unshard starts in this thread. Per thread, so ranks run as threads each
# see only their own.
ACTIVE_OBSERVERS: ContextVar[tuple[CollectiveObserver, ...]] = ContextVar("fully_shard_observers", default=())
