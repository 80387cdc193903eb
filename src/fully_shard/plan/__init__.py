"""Plan before you launch: simulate a training step of this runtime at any world size on one CPU
(``simulate``), and read what it needs per rank (``Plan``)."""

from .memory import CATEGORIES, LiveBytes, Snapshot
from .simulate import Plan, default_shard_fn, measure, simulate

__all__ = ["CATEGORIES", "LiveBytes", "Plan", "Snapshot", "default_shard_fn", "measure", "simulate"]
