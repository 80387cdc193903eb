"""The lifecycles: enums, their transition tables, and the one function that moves along them."""

from __future__ import annotations

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

S = TypeVar("S", ShardedState, TrainingPhase)


def advance(table: dict[S, set[S]], current: S, to: S, owner: str) -> S:
    """Return ``to`` if ``table`` allows ``current -> to`` (staying put always is); else raise,
    naming ``owner`` and both states."""
    if to is not current and to not in table[current]:
        raise RuntimeError(f"fully_shard {owner}: illegal transition {current.name} -> {to.name}")
    return to
