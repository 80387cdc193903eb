"""The watchdog: a CPU wait for a collective that takes too long writes every root's state and every
thread's Python stack to stderr; the wait goes on. Off, a wait costs one attribute lookup.

Imports: torch only (the comm layer waits through `wait`).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import weakref
from typing import Any, Optional

import torch.distributed as dist

ENV_WATCHDOG = "FULLY_SHARD_WATCHDOG"

timeout: Optional[float] = None  # seconds; None: off
_roots: "weakref.WeakSet[Any]" = weakref.WeakSet()  # RootContexts


def set_watchdog(seconds: Optional[float]) -> None:
    """A rank that waits longer than ``seconds`` for one of fully_shard's collectives writes to stderr
    the state of every root in the process and every thread's Python stack; the wait goes on.
    ``None``: off (also the default; ``FULLY_SHARD_WATCHDOG=seconds`` turns it on). CPU waits only:
    on accelerators streams wait, and PyTorch's NCCL watchdog covers them."""
    global timeout
    if seconds is not None and not seconds > 0:
        raise ValueError(f"set_watchdog expects seconds > 0 or None (off), got {seconds!r}.")
    timeout = None if seconds is None else float(seconds)


def register_root(root: Any) -> None:
    _roots.add(root)


def roots() -> list[Any]:
    """Every live `RootContext` in the process."""
    return list(_roots)


def wait(work: Any, what: object, seconds: float) -> None:
    """``work.wait()`` under a ``seconds`` timer; ``what`` names the collective."""
    timer = threading.Timer(seconds, _dump, args=(what, seconds))
    timer.daemon = True
    timer.start()
    try:
        work.wait()
    finally:
        timer.cancel()


def _dump(what: object, seconds: float) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = [f"fully_shard watchdog: rank {rank} has waited more than {seconds:g} s for {what}. FSDP state:"]
    for root in list(_roots):
        lines.extend("  " + line for line in root.describe())
    sys.stderr.write("\n".join(lines) + "\nPython stacks of every thread:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


if os.environ.get(ENV_WATCHDOG, "").strip():
    set_watchdog(float(os.environ[ENV_WATCHDOG]))
