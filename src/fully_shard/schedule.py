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
Off, it costs one global lookup per collective.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

ENV = "FULLY_SHARD_CHECK_SCHEDULE"
ENV_TIMEOUT = "FULLY_SHARD_SCHEDULE_TIMEOUT"
ENV_WATCHDOG = "FULLY_SHARD_WATCHDOG"


class ScheduleDivergence(RuntimeError):
    """Ranks were about to issue different collectives (or one issued none)."""


class ScheduleCheck:
    """Sequence numbers per process group (one process-wide object: every root shares it)."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"the schedule check's timeout must be > 0 seconds, got {timeout!r}.")
        self.timeout = timeout
        self._seq: dict[str, int] = {}
        self._agreed: dict[str, str] = {}
        self._lock = threading.Lock()

    def before(self, op: str, module: str, dtype: torch.dtype, nbytes: int, group: dist.ProcessGroup, phase: str) -> None:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        name = group.group_name
        with self._lock:
            n = self._seq.get(name, 0) + 1
            self._seq[name] = n
        mine = f"{op} of '{module or '<root>'}' ({str(dtype).replace('torch.', '')}, {nbytes} bytes)"
        prefix = f"fully_shard/schedule/{name}/{n}"
        store.set(f"{prefix}/{rank}", f"{mine} [{phase}]")
        ranks = dist.get_process_group_ranks(group)
        others = [r for r in ranks if r != rank]
        try:
            store.wait([f"{prefix}/{r}" for r in others], datetime.timedelta(seconds=self.timeout))
        except Exception:  # the store's own timeout error
            silent = [r for r in others if not store.check([f"{prefix}/{r}"])]
            raise ScheduleDivergence(
                f"fully_shard schedule check: rank {rank} is about to issue collective #{n} on process group "
                f"{name}: {mine} [{phase}], but rank(s) {silent} issued no collective #{n} within {self.timeout:g} s. "
                f"{self._last(name)} {_FIX}"
            ) from None
        seen = {r: store.get(f"{prefix}/{r}").decode() for r in ranks}
        if len({s.rsplit(' [', 1)[0] for s in seen.values()}) > 1:
            listed = "; ".join(f"rank {r}: {s}" for r, s in seen.items())
            raise ScheduleDivergence(
                f"fully_shard schedule check: ranks disagree on collective #{n} on process group {name}: {listed}. "
                f"{self._last(name)} {_FIX}"
            )
        with self._lock:
            self._agreed[name] = f"#{n}: {mine} [{phase}]"
        if n > 1:  # every rank of the group is past #n-1 now: nobody reads that key again
            store.delete_key(f"fully_shard/schedule/{name}/{n - 1}/{rank}")

    def _last(self, name: str) -> str:
        last = self._agreed.get(name)
        return f"The last collective all ranks agreed on: {last}." if last else "No earlier collective on it was checked."


_FIX = (
    "Fix: every rank must run the same sharded modules in the same order, with the same shapes, in every forward "
    "and backward (run skipped blocks on every rank, or give rank-dependent code its own fully_shard root), and one "
    "thread must drive a model at a time."
)

_active: Optional[ScheduleCheck] = None


def set_schedule_check(enabled: bool, timeout: float = 10.0) -> None:
    """Turn the schedule check on (every rank, before its next collective) or off."""
    global _active
    if not isinstance(enabled, bool):
        raise ValueError(f"set_schedule_check(enabled=...) must be True or False, got {enabled!r}.")
    _active = ScheduleCheck(float(timeout)) if enabled else None


def before_collective(op: str, module: str, dtype: torch.dtype, nbytes: int, group: dist.ProcessGroup, phase: str) -> None:
    """Called right before fully_shard issues a collective (a no-op unless the check is on)."""
    if _active is not None:
        _active.before(op, module, dtype, nbytes, group, phase)


# -- watchdog: a wait that takes too long dumps what every root is doing, and the Python stacks --

_watchdog: Optional[float] = None
_roots: "weakref.WeakSet[Any]" = weakref.WeakSet()  # RootContexts (anything with describe() -> list[str])


def set_watchdog(seconds: Optional[float]) -> None:
    """A rank that waits longer than ``seconds`` for one of fully_shard's collectives writes, to
    stderr, the state of every root in the process (phases, which groups are unsharded, work in
    flight) and every thread's Python stack; the wait goes on. ``None``: off. CPU waits only: on
    accelerators the host does not wait for collectives (streams do; PyTorch's NCCL watchdog and
    flight recorder cover those)."""
    global _watchdog
    if seconds is not None and not seconds > 0:
        raise ValueError(f"set_watchdog expects seconds > 0 or None (off), got {seconds!r}.")
    _watchdog = None if seconds is None else float(seconds)


def register_root(root: Any) -> None:
    _roots.add(root)


def wait(work: Any, what: str) -> None:
    """``work.wait()``, under the watchdog's timer when it is on (off: nothing else on this path)."""
    if _watchdog is None:
        work.wait()
        return
    timer = threading.Timer(_watchdog, _dump, args=(what, _watchdog))
    timer.daemon = True
    timer.start()
    try:
        work.wait()
    finally:
        timer.cancel()


def _dump(what: str, seconds: float) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = [f"fully_shard watchdog: rank {rank} has waited more than {seconds:g} s for {what}. FSDP state:"]
    for root in list(_roots):
        lines.extend("  " + line for line in root.describe())
    sys.stderr.write("\n".join(lines) + "\nPython stacks of every thread:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


if os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes"):
    set_schedule_check(True, float(os.environ.get(ENV_TIMEOUT, "10")))
if os.environ.get(ENV_WATCHDOG, "").strip():
    set_watchdog(float(os.environ[ENV_WATCHDOG]))
