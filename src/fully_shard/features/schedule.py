"""Opt-in schedule check: ranks that are about to issue different collectives raise, within
seconds, instead of hanging for the process group's timeout (30 minutes by default) or pairing
the wrong buffers silently.

Before each collective fully_shard issues, a rank writes a fingerprint (op, module(s), dtype,
bytes) under ``fully_shard/schedule/<process group>/<n>/<rank>`` in the default process group's
store (the side channel ``torchrun`` set up; it has nothing to do with the collectives), then
waits, with its own short timeout, for the fingerprints of the other ranks of that process group
for the same sequence number ``n``. Different fingerprints, or one missing after the timeout (a
rank skipped a backward, or is stuck elsewhere), raise `ScheduleDivergence` on the ranks that
see it, naming what each rank was about to do and the last collective they agreed on. Nothing
mismatched is ever issued, so the process group stays usable.

Turn it on with ``fully_shard.debug.set_schedule_check(True, timeout=10.0)`` or the environment
variable ``FULLY_SHARD_CHECK_SCHEDULE=1`` (``FULLY_SHARD_SCHEDULE_TIMEOUT`` seconds, default 10).
It costs one store round trip per collective (benchmarks/bench_step.py ``--schedule-check``).
Off, it costs nothing: no root has the observer (`attach_to`).

Each root (each `CommContext`: roots that share one share it) checks through its own
`ScheduleCheck` observer, with its own sequence numbers, so ranks that run as threads of one
process never share a counter. Its keys carry the root's ordinal on this rank (the n-th root to
turn the check on, counted in the store), which is the same on every rank that builds its
models in the same order.

Imports: the collective descriptor only.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..runtime import watchdog
from ..runtime.collective import Collective

ENV = "FULLY_SHARD_CHECK_SCHEDULE"
ENV_TIMEOUT = "FULLY_SHARD_SCHEDULE_TIMEOUT"


class ScheduleDivergence(RuntimeError):
    """Ranks were about to issue different collectives (or one issued none)."""


@dataclass
class _Sequence:
    """What one root's check has counted since it was turned on."""

    key: str  # fully_shard/schedule/<ordinal of this root on this rank>
    timeout: float
    seq: dict[str, int] = field(default_factory=dict)  # process group name -> collectives checked
    agreed: dict[str, str] = field(default_factory=dict)  # process group name -> the last agreed one


class ScheduleCheck:
    """One root's schedule check (a `CommContext` observer), attached while the process-wide
    setting is on (`attach_to`); a new one starts counting afresh."""

    def __init__(self) -> None:
        self._run: Optional[_Sequence] = None

    def begin_step(self) -> None:
        pass

    def after(self, c: Collective) -> None:
        pass

    def attach(self, root: object) -> None:
        pass

    def before(self, c: Collective) -> None:
        timeout = _timeout
        if timeout is None:
            self._run = None
            return
        if self._run is None or self._run.timeout != timeout:
            ordinal = _store().add(f"fully_shard/schedule/roots/{dist.get_rank()}", 1)
            self._run = _Sequence(f"fully_shard/schedule/{ordinal}", timeout)
        _check(self._run, c)


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _check(run: _Sequence, c: Collective) -> None:
    store, rank, name = _store(), dist.get_rank(), c.group.group_name
    n = run.seq[name] = run.seq.get(name, 0) + 1
    mine = f"{c.describe()} [{c.reason.value}]"
    prefix = f"{run.key}/{name}/{n}"
    store.set(f"{prefix}/{rank}", mine)
    ranks = dist.get_process_group_ranks(c.group)
    others = [r for r in ranks if r != rank]
    try:
        store.wait([f"{prefix}/{r}" for r in others], datetime.timedelta(seconds=run.timeout))
    except Exception:  # the store's own timeout error
        silent = [r for r in others if not store.check([f"{prefix}/{r}"])]
        raise ScheduleDivergence(
            f"fully_shard schedule check: rank {rank} is about to issue collective #{n} on process group "
            f"{name}: {mine}, but rank(s) {silent} issued no collective #{n} within {run.timeout:g} s. "
            f"{_last(run, name)} {_FIX}"
        ) from None
    seen = {r: store.get(f"{prefix}/{r}").decode() for r in ranks}
    if len({s.rsplit(" [", 1)[0] for s in seen.values()}) > 1:
        listed = "; ".join(f"rank {r}: {s}" for r, s in seen.items())
        raise ScheduleDivergence(
            f"fully_shard schedule check: ranks disagree on collective #{n} on process group {name}: "
            f"{listed}. {_last(run, name)} {_FIX}"
        )
    run.agreed[name] = f"#{n}: {mine}"
    if n > 1:  # every rank of the group is past #n-1 now: nobody reads that key again
        store.delete_key(f"{run.key}/{name}/{n - 1}/{rank}")


def _last(run: _Sequence, name: str) -> str:
    last = run.agreed.get(name)
    return (
        f"The last collective all ranks agreed on: {last}."
        if last
        else "No earlier collective on it was checked."
    )


_FIX = (
    "Fix: every rank must run the same sharded modules in the same order, with the same shapes, in every "
    "forward and backward (run skipped blocks on every rank, or give rank-dependent code its own fully_shard "
    "root), and one thread must drive a model at a time."
)

# The process-wide setting (a timeout in seconds, or None: off). Each root's check reads it; the
# counting state is the root's own.
_timeout: Optional[float] = None


def set_schedule_check(enabled: bool, timeout: float = 10.0) -> None:
    """Turn the schedule check on (every root, before its next collective) or off."""
    global _timeout
    if not isinstance(enabled, bool):
        raise ValueError(f"set_schedule_check(enabled=...) must be True or False, got {enabled!r}.")
    if enabled and not float(timeout) > 0:
        raise ValueError(f"the schedule check's timeout must be > 0 seconds, got {timeout!r}.")
    _timeout = float(timeout) if enabled else None
    for root in watchdog.roots():  # roots already running; new ones attach at lazy init
        attach_to(root)


def attach_to(root: Any) -> None:
    """Give ``root`` (a `RootContext`) a `ScheduleCheck` while the check is on, and take it away
    while it is off (roots sharing a `CommContext` share one)."""
    observers = root.comm.observers
    mine = [o for o in observers if isinstance(o, ScheduleCheck)]
    if _timeout is None:
        for o in mine:
            observers.remove(o)
    elif not mine:
        observers.append(ScheduleCheck())


if os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes"):
    set_schedule_check(True, float(os.environ.get(ENV_TIMEOUT, "10")))
