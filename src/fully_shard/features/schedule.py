"""Opt-in schedule check (docs/reliability.md): before each collective, ranks compare fingerprints
through the default store and raise `ScheduleDivergence` within seconds instead of hanging or
pairing the wrong buffers; nothing mismatched is issued. Each root counts on its own, so ranks run
as threads never share a counter; its store keys carry the root's ordinal on this rank.
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
    """One root's check (a `CommContext` observer); a new one starts counting afresh."""

    def __init__(self) -> None:
        self._run: Optional[_Sequence] = None

    # Observer hooks the check has no use for.
    def begin_step(self) -> None: ...

    def after(self, c: Collective) -> None: ...

    def attach(self, root: object) -> None: ...

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

# The process-wide setting: a timeout in seconds, or None (off). Counting is each root's own.
_timeout: Optional[float] = None


def set_schedule_check(enabled: bool, timeout: float = 10.0) -> None:
    """Turn the schedule check on (every root, from its next collective) or off.
    Raises ``ValueError`` unless ``enabled`` is a bool and ``timeout`` > 0 seconds."""
    global _timeout
    if not isinstance(enabled, bool):
        raise ValueError(f"set_schedule_check(enabled=...) must be True or False, got {enabled!r}.")
    if enabled and not float(timeout) > 0:
        raise ValueError(f"the schedule check's timeout must be > 0 seconds, got {timeout!r}.")
    _timeout = float(timeout) if enabled else None
    for root in watchdog.roots():  # roots already running; new ones attach at lazy init
        attach_to(root)


def attach_to(root: Any) -> None:
    """Give ``root`` (a `RootContext`) a `ScheduleCheck` while the check is on, remove it while off."""
    observers = root.comm.observers
    mine = [o for o in observers if isinstance(o, ScheduleCheck)]
    if _timeout is None:
        for o in mine:
            observers.remove(o)
    elif not mine:
        observers.append(ScheduleCheck())


if os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes"):
    set_schedule_check(True, float(os.environ.get(ENV_TIMEOUT, "10")))
