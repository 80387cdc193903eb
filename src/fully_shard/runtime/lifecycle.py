"""The lifecycles: enums, the transition record `Step`, and the functions that move along them.

The tables themselves live beside their owners (`state.MODULE`, `root.ITERATION`), because each
entry holds a reference to the owner's method that runs: the table, not a string, decides.

Imports: nothing of this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable, Optional, TypeVar, Union


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()
    # Groups only (reshard_after_forward=int): between forward and backward, sharded over a
    # smaller group. Parameters themselves are SHARDED then (modules see the shards).
    SHARDED_POST_FORWARD = auto()


GROUP_STATES: dict[ShardedState, set[ShardedState]] = {
    ShardedState.SHARDED: {ShardedState.UNSHARDED},
    ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD},
    ShardedState.SHARDED_POST_FORWARD: {ShardedState.UNSHARDED, ShardedState.SHARDED},
}


class TrainingPhase(Enum):
    """Where one sharded module is in the iteration (`FSDPState.phase`)."""

    IDLE = auto()
    FORWARD = auto()  # between its pre-forward and its post-forward
    PRE_BACKWARD = auto()  # its outputs got gradients; its parameters' gradients are being made
    POST_BACKWARD = auto()  # its gradients are being resharded and reduced


class ModuleEvent(Enum):
    """What a sharded module's hooks report (`FSDPState.handle`)."""

    FORWARD = auto()  # pre-forward, outside backward
    FORWARD_DONE = auto()  # post-forward, outside backward (of one module of a list-form call)
    RECOMPUTE = auto()  # pre-forward inside backward: activation checkpointing recomputes it
    RECOMPUTE_DONE = auto()  # post-forward inside backward
    PRE_BACKWARD = auto()  # its outputs got their gradients
    SIGNAL = auto()  # a post-backward signal fired: the gradients of one forward use exist
    BACKWARD_END = auto()  # the root's end of backward: reduce what no signal covered
    RESET = auto()


class IterationPhase(Enum):
    """Where one root's training iteration is (`RootContext.phase`)."""

    IDLE = auto()  # no forward since the last backward finished (or ever)
    FORWARD = auto()  # a root forward started; no backward yet
    BACKWARD = auto()  # a module's outputs got gradients; the end-of-backward callback is queued
    FINALIZING = auto()  # the end-of-backward callback is running


class Event(Enum):
    """What the hooks report to the root (`RootContext.handle`)."""

    ROOT_FORWARD = auto()  # the root's forward starts, outside any backward
    RECOMPUTE = auto()  # a forward inside backward (activation checkpointing recomputes)
    PRE_BACKWARD = auto()  # a sharded module's outputs got their gradients
    BACKWARD_END = auto()  # autograd ran the queued end-of-backward callback
    RESET = auto()  # reset_iter_state(): forget the iteration in flight


@dataclass(frozen=True)
class Step:
    """A transition: the phase to enter, the owner's method that runs in it (None: nothing), and
    the phase to enter once it returns (None: stay). ``when``: a guard on the owner and the
    event's payload; a table entry may list several steps, the first whose guard holds is taken."""

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
    """The step ``table`` gives for ``event`` in ``phase`` (the first whose guard holds on
    ``guard_args``); raise, naming ``name`` and both, if none. ``name`` may be a callable, called
    only then (the hot path formats no name)."""
    entry = table.get((phase, event))
    for step in (entry,) if isinstance(entry, Step) else entry or ():
        if step.when is None or step.when(*guard_args):
            return step
    raise RuntimeError(
        f"fully_shard {name() if callable(name) else name}: {event.name} is not expected while in "
        f"{phase.name}; this is a bug in fully_shard, please report it with the trace "
        "(fully_shard.debug.trace())."
    )


S = TypeVar("S", ShardedState, TrainingPhase)


def advance(table: dict[S, set[S]], current: S, to: S, name: str) -> S:
    """Return ``to`` if ``table`` allows ``current -> to`` (staying put always is); else raise,
    naming ``name`` and both states."""
    if to is not current and to not in table[current]:
        raise RuntimeError(f"fully_shard {name}: illegal transition {current.name} -> {to.name}")
    return to
