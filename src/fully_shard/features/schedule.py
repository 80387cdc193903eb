"""Opt-in schedule check (docs/reliability.md): before each collective, ranks compare fingerprints
through the default store and raise `ScheduleDivergence` within seconds instead of hanging or
pairing the wrong buffers; nothing mismatched is issued. A rank that has not arrived is late, not
divergent: warned after the check's timeout, `LateRank` past the process group's. A rank whose check
is off leaves its groups unchecked (warned). Each root counts on its own, so ranks run
as threads never share a counter; its store keys carry the root's ordinal on this rank.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..runtime import watchdog
from ..runtime.collective import Collective

ENV = "FULLY_SHARD_CHECK_SCHEDULE"
ENV_TIMEOUT = "FULLY_SHARD_SCHEDULE_TIMEOUT"


class ScheduleDivergence(RuntimeError):
    """Ranks were about to issue different collectives."""


class LateRank(ScheduleDivergence):
    """A rank of the group did not reach the collective within the process group's timeout (late,
    stopped or hung: not shown to diverge). A `ScheduleDivergence`, so one ``except`` catches both."""


@dataclass
class _Sequence:
    """What one root's check has counted since it was turned on."""

    key: str  # fully_shard/schedule/<ordinal of this root on this rank>
    timeout: float
    seq: dict[str, int] = field(default_factory=dict)  # process group name -> collectives checked
    agreed: dict[str, str] = field(default_factory=dict)  # process group name -> the last agreed one
    unchecked: set[str] = field(default_factory=set)  # groups with a rank whose check is off


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
            _announce()
            ordinal = _store().add(f"fully_shard/schedule/roots/{dist.get_rank()}", 1)
            self._run = _Sequence(f"fully_shard/schedule/{ordinal}", timeout)
        if c.group.group_name not in self._run.unchecked:
            _check(self._run, c)


def _announce() -> None:
    """Tell the other ranks this rank checks (a rank that never says so has the check off)."""
    _store().set(f"{_ON}/{dist.get_rank()}", "1")


_ON = "fully_shard/schedule/on"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _check(run: _Sequence, c: Collective) -> None:
    store, rank, name = _store(), dist.get_rank(), c.group.group_name
    n = run.seq[name] = run.seq.get(name, 0) + 1
    mine = f"{c.describe()} [{c.reason.value}]"
    prefix = f"{run.key}/{name}/{n}"
    store.set(f"{prefix}/{rank}", mine)
    ranks = dist.get_process_group_ranks(c.group)
    if not _wait_for_others(run, c, prefix, [r for r in ranks if r != rank], n, mine):
        return  # a rank of this group does not check: this rank stops checking it too
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


def _wait_for_others(
    run: _Sequence, c: Collective, prefix: str, others: list[int], n: int, mine: str
) -> bool:
    """Until every other rank posted its collective #n: True. A rank that never turned the check on:
    warned, the group left unchecked, False. One still silent after the check's timeout is late (a
    slow step is not a divergence): warned, waited for up to the process group's timeout, then
    `LateRank`."""
    store, name, waited, warned = _store(), c.group.group_name, 0.0, False
    limit = _group_timeout(c.group)
    while True:
        step = min(run.timeout, max(limit - waited, 0.001))
        try:
            store.wait([f"{prefix}/{r}" for r in others], datetime.timedelta(seconds=step))
            return True
        except Exception:  # the store's own timeout error
            waited += step
        silent = [r for r in others if not store.check([f"{prefix}/{r}"])]
        off = [r for r in silent if not store.check([f"{_ON}/{r}"])]
        if off:
            run.unchecked.add(name)
            warnings.warn(
                f"fully_shard schedule check: it is off on rank(s) {off} of process group {name} (on for "
                f"rank {dist.get_rank()}), so this rank stops checking that group. Fix: turn it on on every "
                "rank (set_schedule_check(True) on each, or FULLY_SHARD_CHECK_SCHEDULE=1 in every rank's "
                "environment).",
                stacklevel=5,
            )
            return False
        where = f"collective #{n} on process group {name} ({mine})"
        if waited >= limit:
            raise LateRank(
                f"fully_shard schedule check: rank(s) {silent} did not reach {where} within the process "
                f"group's timeout ({limit:g} s): late, stopped or hung (nothing shows they diverge). "
                f"{_last(run, name)} Fix: find what holds them (fully_shard.debug.set_watchdog dumps "
                f"their stacks); if they skipped work the others did: {_FIX[5:]}"
            )
        if not warned:
            warned = True
            warnings.warn(
                f"fully_shard schedule check: rank(s) {silent} have not reached {where} after {waited:g} s; "
                f"waiting (late is not divergent) up to the process group's timeout ({limit:g} s).",
                stacklevel=5,
            )


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The process group's own timeout in seconds (PyTorch's default where it does not say)."""
    for device_type in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout.total_seconds()


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
    if dist.is_initialized():  # said now, so a rank late to its first collective is not taken as off
        if enabled:
            _announce()
        else:
            _store().delete_key(f"{_ON}/{dist.get_rank()}")
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
