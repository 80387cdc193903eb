"""The lifecycles' enums, the transition record `Step`, and the lookups. The tables that name
methods live beside their owners (`state.MODULE`, `state.ITERATION`).

Imports: nothing of this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, Optional, Union


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()
    # Groups only (reshard_after_forward=int): between forward and backward, sharded over a smaller
    # group; the parameters themselves show their SHARDED form.
    SHARDED_POST_FORWARD = auto()


GROUP_STATES: dict[ShardedState, set[ShardedState]] = {
    ShardedState.SHARDED: {ShardedState.UNSHARDED},
    ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD},
    ShardedState.SHARDED_POST_FORWARD: {ShardedState.UNSHARDED, ShardedState.SHARDED},
}


class TrainingPhase(Enum):
    """Where one sharded module is in the iteration (`FSDPState.phase`)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # its outputs got gradients; its parameters' gradients are being made
    POST_BACKWARD = auto()  # its gradients are being resharded and reduced


class ModuleEvent(Enum):
    """What a sharded module's hooks report (`FSDPState.handle`)."""

    FORWARD = auto()
    FORWARD_DONE = auto()  # of one module of a list-form call
    RECOMPUTE = auto()  # a forward inside backward (activation checkpointing)
    RECOMPUTE_DONE = auto()
    PRE_BACKWARD = auto()
    SIGNAL = auto()  # a post-backward signal fired: the gradients of one forward use exist
    BACKWARD_END = auto()  # the root's end of backward: reduce what no signal covered
    RESET = auto()
    REDUCE_GRADS = auto()  # the root's reduce_grads(): reduce what accumulated, reshard


class IterationPhase(Enum):
    """Where one root's training iteration is (`RootContext.phase`)."""

    IDLE = auto()  # no forward since the last backward finished
    FORWARD = auto()
    BACKWARD = auto()  # the end-of-backward callback is queued
    FINALIZING = auto()  # the end-of-backward callback is running


class Event(Enum):
    """What the hooks report to the root (`RootContext.handle`)."""

    ROOT_FORWARD = auto()
    RECOMPUTE = auto()  # a forward inside backward
    PRE_BACKWARD = auto()  # a sharded module's outputs got their gradients
    BACKWARD_END = auto()  # autograd ran the queued end-of-backward callback
    RESET = auto()  # reset_iter_state()
    REDUCE_GRADS = auto()  # FSDPModule.reduce_grads(): a backward finished by hand


@dataclass(frozen=True)
class Step:
    """Enter ``to``, run the owner's ``action`` (if any), then enter ``then`` (None: stay).
    ``when``: a guard on the owner and the event's payload; of an entry's several steps, the first
    whose guard holds is taken."""

    to: Enum
    action: Optional[Callable[..., Any]] = None
    then: Optional[Enum] = None
    when: Optional[Callable[..., bool]] = None


Entry = Union[Step, tuple[Step, ...]]


def step_for(
    table: dict[tuple[Any, Any], Entry],
    phase: Enum,
    event: Enum,
    name: Union[str, Callable[[], str]],
    *guard_args: Any,
) -> Step:
    """The step ``table`` gives for ``event`` in ``phase``, guards called with ``guard_args``; raise,
    naming ``name`` and both, if none. A callable ``name`` is called only to raise."""
    entry = table.get((phase, event))
    for step in (entry,) if isinstance(entry, Step) else entry or ():
        if step.when is None or step.when(*guard_args):
            return step
    raise RuntimeError(
        f"fully_shard {name() if callable(name) else name}: {event.name} is not expected while in "
        f"{phase.name}; this is a bug in fully_shard, please report it with the trace "
        "(fully_shard.debug.trace())."
    )


def advance(
    table: dict[ShardedState, set[ShardedState]], current: ShardedState, to: ShardedState, name: str
) -> ShardedState:
    """Return ``to`` if ``table`` allows ``current -> to`` (staying put always is); else raise."""
    if to is not current and to not in table[current]:
        raise RuntimeError(f"fully_shard {name}: illegal transition {current.name} -> {to.name}")
    return to
