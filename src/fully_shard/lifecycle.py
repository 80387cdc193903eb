"""The lifecycles: enums, their transition tables, and the one function that moves along them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Optional, TypeVar


class ShardedState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()
    # Groups only (reshard_after_forward=int): between forward and backward, sharded over a
    # smaller group. Parameters themselves are SHARDED then (modules see the shards).
    SHARDED_POST_FORWARD = auto()


class TrainingPhase(Enum):
    """Where one sharded module is in the iteration (`FSDPState.phase`)."""

    IDLE = auto()
    FORWARD = auto()  # between its pre-forward and its post-forward
    PRE_BACKWARD = auto()  # its outputs got gradients; its parameters' gradients are being made
    POST_BACKWARD = auto()  # its gradients are being resharded and reduced


GROUP_STATES: dict[ShardedState, set[ShardedState]] = {
    ShardedState.SHARDED: {ShardedState.UNSHARDED},
    ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD},
    ShardedState.SHARDED_POST_FORWARD: {ShardedState.UNSHARDED, ShardedState.SHARDED},
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
    RESET = auto()  # reset_iter_state(): forget the iteration in flight


@dataclass(frozen=True)
class Step:
    """A transition: the phase to enter, the method that runs in it (``""``: none), and the phase
    to enter once that method returns (``None``: stay)."""

    to: Enum
    action: str = ""
    then: Optional[Enum] = None


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
    (_I.BACKWARD, _E.BACKWARD_END): Step(_I.FINALIZING, "finish_backward", then=_I.IDLE),
    **{(phase, _E.RESET): Step(_I.IDLE, "reset_iteration") for phase in IterationPhase},
}


class ModuleEvent(Enum):
    """What a sharded module's hooks report (`FSDPState.handle`)."""

    FORWARD = auto()  # pre-forward, outside backward
    FORWARD_DONE = auto()  # post-forward (of every module of a list-form call)
    RECOMPUTE = auto()  # pre-forward inside backward: activation checkpointing recomputes it
    PRE_BACKWARD = auto()  # its outputs got their gradients
    GRADIENTS_READY = auto()  # post-backward signal: every gradient of its first forward use exists
    BACKWARD_END = auto()  # the root's end of backward: reduce what no signal covered
    RESET = auto()


_P, _M = TrainingPhase, ModuleEvent
# One sharded module: (phase, event) -> Step; the `FSDPState` method named runs. A pair missing
# here raises, naming the module and both. RECOMPUTE, BACKWARD_END and RESET can come in any phase.
MODULE: dict[tuple[TrainingPhase, ModuleEvent], Step] = {
    (_P.IDLE, _M.FORWARD): Step(_P.FORWARD, "unshard_for_forward"),
    # List form: the next module of the call; or a module that runs inside its own forward.
    (_P.FORWARD, _M.FORWARD): Step(_P.FORWARD, "unshard_for_forward"),
    (_P.FORWARD, _M.FORWARD_DONE): Step(_P.IDLE, "after_forward"),
    # Gradients reach the module's outputs (also while its forward runs: autograd.grad inside it).
    (_P.IDLE, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, "unshard_for_backward"),
    (_P.FORWARD, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, "unshard_for_backward"),
    # Used twice in forward: its second use's outputs get gradients too.
    (_P.PRE_BACKWARD, _M.PRE_BACKWARD): Step(_P.PRE_BACKWARD, "unshard_for_backward"),
    # The signal fires when the module's parameter gradients exist; with several forward uses, once
    # for all of them. Without a pre-backward (its outputs reached the loss only untracked) too.
    **{(p, _M.GRADIENTS_READY): Step(_P.POST_BACKWARD, "reduce", then=_P.IDLE) for p in (_P.IDLE, _P.PRE_BACKWARD)},
    **{(p, _M.RECOMPUTE): Step(p, "unshard_for_recompute") for p in TrainingPhase},
    **{(p, _M.BACKWARD_END): Step(_P.POST_BACKWARD, "reduce_leftovers", then=_P.IDLE) for p in TrainingPhase},
    **{(p, _M.RESET): Step(_P.IDLE, "reset_module") for p in TrainingPhase},
}


def step_for(table: dict[tuple[Enum, Enum], Step], phase: Enum, event: Enum, owner: str) -> Step:
    """The transition ``table`` gives for ``event`` in ``phase``; raise, naming ``owner``, if none."""
    step = table.get((phase, event))
    if step is None:
        raise RuntimeError(
            f"fully_shard {owner}: {event.name} is not expected while in {phase.name}; this is a bug in "
            "fully_shard, please report it with the trace (fully_shard.debug.trace())."
        )
    return step


S = TypeVar("S", ShardedState, TrainingPhase)


def advance(table: dict[S, set[S]], current: S, to: S, owner: str) -> S:
    """Return ``to`` if ``table`` allows ``current -> to`` (staying put always is); else raise,
    naming ``owner`` and both states."""
    if to is not current and to not in table[current]:
        raise RuntimeError(f"fully_shard {owner}: illegal transition {current.name} -> {to.name}")
    return to
