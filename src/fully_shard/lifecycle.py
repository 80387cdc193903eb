"""The lifecycles: enums, their transition tables, and the one function that moves along them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TypeVar


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()
    # Groups only (reshard_after_forward=int): between forward and backward, sharded over a
    # smaller group. Parameters themselves are SHARDED then (modules see the shards).
    SHARDED_POST_FORWARD = auto()


class TrainingPhase(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


GROUP_STATES: dict[ShardedState, set[ShardedState]] = {
    ShardedState.SHARDED: {ShardedState.UNSHARDED},
    ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD},
    ShardedState.SHARDED_POST_FORWARD: {ShardedState.UNSHARDED, ShardedState.SHARDED},
}

# FORWARD from PRE_BACKWARD: activation checkpointing recomputes forward inside backward.
# POST_BACKWARD from IDLE/FORWARD: the end-of-backward callback finishes groups whose
# pre-backward hook never fired (their outputs did not reach the loss through a hooked tensor).
PHASES: dict[TrainingPhase, set[TrainingPhase]] = {
    TrainingPhase.IDLE: {TrainingPhase.FORWARD, TrainingPhase.PRE_BACKWARD, TrainingPhase.POST_BACKWARD},
    TrainingPhase.FORWARD: {TrainingPhase.IDLE, TrainingPhase.PRE_BACKWARD, TrainingPhase.POST_BACKWARD},
    TrainingPhase.PRE_BACKWARD: {TrainingPhase.FORWARD, TrainingPhase.POST_BACKWARD, TrainingPhase.IDLE},
    TrainingPhase.POST_BACKWARD: {TrainingPhase.IDLE},
}

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
    FINALIZED = auto()  # that callback finished its work
    RESET = auto()  # reset_iter_state(): forget the iteration in flight


@dataclass(frozen=True)
class Step:
    """A transition: the phase to enter and the `RootContext` method that runs (``""``: none)."""

    to: IterationPhase
    action: str = ""


_I, _E = IterationPhase, Event
# The root's iteration: (phase, event) -> Step. A pair missing here is a bug in the caller's
# sequence and raises, naming both. This table decides what runs; the hooks only report events.
ITERATION: dict[tuple[IterationPhase, Event], Step] = {
    (_I.IDLE, _E.ROOT_FORWARD): Step(_I.FORWARD, "start_iteration"),
    # Several forwards before one backward (an evaluation forward, or two losses summed).
    (_I.FORWARD, _E.ROOT_FORWARD): Step(_I.FORWARD, "start_iteration"),
    # A forward while backward is in flight: that backward raised, so autograd never ran the
    # end-of-backward callback. Recover (reshard, drop its unreduced gradients), then start.
    (_I.BACKWARD, _E.ROOT_FORWARD): Step(_I.FORWARD, "recover_and_start"),
    (_I.FINALIZING, _E.ROOT_FORWARD): Step(_I.FORWARD, "recover_and_start"),
    # Recomputation inside backward changes nothing at the root (the groups decide what to gather).
    **{(phase, _E.RECOMPUTE): Step(phase) for phase in IterationPhase},
    (_I.FORWARD, _E.PRE_BACKWARD): Step(_I.BACKWARD, "begin_backward"),
    # A backward with no forward since the last one ended: a retained graph run again.
    (_I.IDLE, _E.PRE_BACKWARD): Step(_I.BACKWARD, "begin_backward"),
    (_I.BACKWARD, _E.PRE_BACKWARD): Step(_I.BACKWARD),
    (_I.BACKWARD, _E.BACKWARD_END): Step(_I.FINALIZING, "finish_backward"),
    (_I.FINALIZING, _E.FINALIZED): Step(_I.IDLE),
    **{(phase, _E.RESET): Step(_I.IDLE, "reset_iteration") for phase in IterationPhase},
}


S = TypeVar("S", ShardedState, TrainingPhase)


def advance(table: dict[S, set[S]], current: S, to: S, owner: str) -> S:
    """Return ``to`` if ``table`` allows ``current -> to`` (staying put always is); else raise,
    naming ``owner`` and both states."""
    if to is not current and to not in table[current]:
        raise RuntimeError(f"fully_shard {owner}: illegal transition {current.name} -> {to.name}")
    return to
